"""ggml's block formats (GGUF's Q8_0, Q4_0, Q4_K, Q6_K): numpy quantizers, the `QuantArray`
pytree and its dequantization in JAX.  The package's floor: it imports nothing of moejax."""
