// Quantizes a GGUF through libllama's llama_model_quantize, for benchmarks/llama_cpp.py.
//
//   llama_quantize IN.gguf OUT.gguf FTYPE PURE THREADS
//
// FTYPE: q8_0, q4_0 or q4_k_m (llama_ftype MOSTLY_Q8_0 / MOSTLY_Q4_0 / MOSTLY_Q4_K_M).
// PURE 1: every quantizable tensor in FTYPE's type (llama-quantize --pure: the embeddings
// and the output too); PURE 0: llama-quantize's default mix for FTYPE (Q4_K_M: Q6_K for the
// output and half of attn_v / ffn_down, Q4_K for the rest).  Either way 1-D tensors
// (norms) and the expert routers (ffn_gate_inp) keep their type, as llama-quantize does.
// This is the function llama-quantize's main() calls; linking only libllama spares
// building llama.cpp's common library (tools/quantize needs it).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s IN.gguf OUT.gguf q8_0|q4_0|q4_k_m PURE(0|1) THREADS\n",
                 argv[0]);
    return 2;
  }
  const std::string t = argv[3];
  llama_model_quantize_params p = llama_model_quantize_default_params();
  if (t == "q8_0") {
    p.ftype = LLAMA_FTYPE_MOSTLY_Q8_0;
  } else if (t == "q4_0") {
    p.ftype = LLAMA_FTYPE_MOSTLY_Q4_0;
  } else if (t == "q4_k_m") {
    p.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M;
  } else {
    std::fprintf(stderr, "llama_quantize: unknown type %s (q8_0, q4_0, q4_k_m)\n", argv[3]);
    return 2;
  }
  p.pure = std::atoi(argv[4]) != 0;
  p.nthread = std::atoi(argv[5]);
  llama_backend_init();
  const uint32_t rc = llama_model_quantize(argv[1], argv[2], &p);
  llama_backend_free();
  if (rc != 0) {
    std::fprintf(stderr, "llama_quantize: quantizing %s failed (%u)\n", argv[1], rc);
    return 1;
  }
  return 0;
}
