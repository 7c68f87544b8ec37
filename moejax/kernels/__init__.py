"""Optional C++ CPU kernels (built on first use on CPU back-ends only) and their JAX wrappers."""
