"""Weights in ggml's block formats on disk: a float checkpoint repacked once (`quantized`,
--weights) and a GGUF file read in place (`gguf_file`)."""
