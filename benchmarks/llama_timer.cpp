// Times llama.cpp through its C API (libllama), for benchmarks/peers.py.
//
//   llama_timer MODEL.gguf THREADS PREFILL_LEN PROMPT_LEN DECODE_TOKENS [TOKENS_FILE]
//
// After a short warm-up: prefill = one llama_decode of PREFILL_LEN tokens (logits at the
// last position only); decode = DECODE_TOKENS single-token steps after a PROMPT_LEN-token
// prompt (the prompt is not timed).  With TOKENS_FILE (token ids, one per line: the
// benchmarks' held-out stream, benchmarks/stream.py) every token comes from the file: the
// prefill reads its first PREFILL_LEN ids, the prompt its first PROMPT_LEN, and decode step
// i is teacher-forced with id PROMPT_LEN + i, as moejax decodes the same stream; without
// it the tokens are random and decode is greedy.  Prints one JSON line, with
// the disk bytes this process read (/proc/self/io read_bytes) during prefill and during
// decode (-1 where /proc cannot be read): a model larger than RAM is read through mmap.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <cstring>
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
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: %s MODEL.gguf THREADS PREFILL_LEN PROMPT_LEN DECODE_TOKENS "
                 "[TOKENS_FILE]\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[2]), prefill = std::atoi(argv[3]),
            prompt = std::atoi(argv[4]), steps = std::atoi(argv[5]);
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model_params mparams = llama_model_default_params();
  // LLAMA_TIMER_NO_REPACK=1: the weights stay in the mapped file (llama-cli's --no-repack);
  // otherwise the CPU backend copies Q4_0/Q8_0 weights into repacked anonymous buffers.
  const char* no_repack = std::getenv("LLAMA_TIMER_NO_REPACK");
  if (no_repack != nullptr && std::strcmp(no_repack, "1") == 0) mparams.use_extra_bufts = false;
  llama_model* model = llama_model_load_from_file(argv[1], mparams);
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
  const bool forced = argc == 7;
  std::vector<llama_token> toks;
  if (forced) {
    std::ifstream f(argv[6]);
    long long id;
    while (f >> id) {
      if (id < 0 || id >= vocab) {
        std::fprintf(stderr, "llama_timer: %s: token id %lld outside the vocabulary of %d\n",
                     argv[6], id, vocab);
        return 2;
      }
      toks.push_back(static_cast<llama_token>(id));
    }
    const size_t need = std::max<size_t>({size_t(prefill), size_t(prompt + steps + 1), 13});
    if (toks.size() < need) {
      std::fprintf(stderr, "llama_timer: %s holds %zu token ids, fewer than the %zu needed\n",
                   argv[6], toks.size(), need);
      return 2;
    }
  } else {
    std::mt19937 rng(0);
    toks.resize(std::max(prefill, prompt) + 8);
    for (auto& t : toks) t = static_cast<llama_token>(rng() % vocab);
  }
  // the next input: teacher-forced from the file, else the greedy choice
  auto next = [&](int i) {
    return forced ? toks[i] : argmax(llama_get_logits_ith(ctx, -1), vocab);
  };

  // warm-up: a short prompt and a few steps
  check(llama_decode(ctx, llama_batch_get_one(toks.data(), 8)), "warm-up prefill");
  llama_token tok = next(8);
  for (int i = 0; i < 4; ++i) {
    check(llama_decode(ctx, llama_batch_get_one(&tok, 1)), "warm-up decode");
    tok = next(9 + i);
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
  tok = next(prompt);
  r0 = disk_read_bytes();
  t0 = now();
  for (int i = 0; i < steps; ++i) {
    check(llama_decode(ctx, llama_batch_get_one(&tok, 1)), "decode");
    tok = next(prompt + i + 1);
  }
  const double decode_s = now() - t0;
  const long long decode_read = r0 < 0 ? -1 : disk_read_bytes() - r0;
  std::printf("{\"prefill_tok_s\": %.3f, \"decode_tok_s\": %.3f, \"prefill_read_bytes\": %lld, "
              "\"decode_read_bytes\": %lld, \"teacher_forced\": %s}\n", prefill / prefill_s,
              steps / decode_s, prefill_read, decode_read, forced ? "true" : "false");
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
