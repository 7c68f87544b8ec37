// Times llama.cpp through its C API (libllama), for benchmarks/peers.py.
//
//   llama_timer MODEL.gguf THREADS PREFILL_LEN PROMPT_LEN DECODE_TOKENS
//
// After a short warm-up: prefill = one llama_decode of PREFILL_LEN random tokens
// (logits at the last position only); decode = DECODE_TOKENS greedy single-token steps
// after a PROMPT_LEN-token prompt (the prompt is not timed). Prints one JSON line, with
// the disk bytes this process read (/proc/self/io read_bytes) during prefill and during
// decode (-1 where /proc cannot be read): a model larger than RAM is read through mmap.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "llama.h"

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static long long disk_read_bytes() {
  long long v = -1;
  if (FILE* f = std::fopen("/proc/self/io", "r")) {
    char key[64];
    long long x;
    while (std::fscanf(f, "%63s %lld", key, &x) == 2)
      if (std::string(key) == "read_bytes:") v = x;
    std::fclose(f);
  }
  return v;
}

static void check(int32_t rc, const char* what) {
  if (rc != 0) {
    std::fprintf(stderr, "llama_timer: %s failed (%d)\n", what, rc);
    std::exit(1);
  }
}

static llama_token argmax(const float* logits, int32_t n) {
  llama_token best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s MODEL.gguf THREADS PREFILL_LEN PROMPT_LEN DECODE_TOKENS\n",
                 argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[2]), prefill = std::atoi(argv[3]),
            prompt = std::atoi(argv[4]), steps = std::atoi(argv[5]);
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == nullptr) {
    std::fprintf(stderr, "llama_timer: cannot load %s\n", argv[1]);
    return 1;
  }
  const int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = std::max(prefill, prompt + steps) + 16;
  cp.n_batch = cp.n_ubatch = std::max(prefill, prompt);
  cp.n_threads = cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  std::mt19937 rng(0);
  std::vector<llama_token> toks(std::max(prefill, prompt));
  for (auto& t : toks) t = static_cast<llama_token>(rng() % vocab);

  // warm-up: a short prompt and a few steps
  check(llama_decode(ctx, llama_batch_get_one(toks.data(), 8)), "warm-up prefill");
  llama_token tok = argmax(llama_get_logits_ith(ctx, -1), vocab);
  for (int i = 0; i < 4; ++i) {
    check(llama_decode(ctx, llama_batch_get_one(&tok, 1)), "warm-up decode");
    tok = argmax(llama_get_logits_ith(ctx, -1), vocab);
  }

  llama_memory_clear(llama_get_memory(ctx), true);
  long long r0 = disk_read_bytes();
  double t0 = now();
  check(llama_decode(ctx, llama_batch_get_one(toks.data(), prefill)), "prefill");
  llama_synchronize(ctx);
  const double prefill_s = now() - t0;
  const long long prefill_read = r0 < 0 ? -1 : disk_read_bytes() - r0;

  llama_memory_clear(llama_get_memory(ctx), true);
  check(llama_decode(ctx, llama_batch_get_one(toks.data(), prompt)), "prompt");
  tok = argmax(llama_get_logits_ith(ctx, -1), vocab);
  r0 = disk_read_bytes();
  t0 = now();
  for (int i = 0; i < steps; ++i) {
    check(llama_decode(ctx, llama_batch_get_one(&tok, 1)), "decode");
    tok = argmax(llama_get_logits_ith(ctx, -1), vocab);
  }
  const double decode_s = now() - t0;
  const long long decode_read = r0 < 0 ? -1 : disk_read_bytes() - r0;
  std::printf("{\"prefill_tok_s\": %.3f, \"decode_tok_s\": %.3f, \"prefill_read_bytes\": %lld, "
              "\"decode_read_bytes\": %lld}\n", prefill / prefill_s, steps / decode_s,
              prefill_read, decode_read);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
