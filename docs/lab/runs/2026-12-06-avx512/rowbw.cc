// Read bandwidth of cpu_dot.h's decode dot (one token) over 1.5 GB of bf16 rows of 2048, cycled: the
// widened path (f32 token) against bf16 pairs (bf16 token), 1 and 2 threads, one row at a time and two.
// g++ -O3 -march=native -std=c++17 -pthread -I moejax/kernels rowbw.cc -o rowbw && ./rowbw
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#include "cpu_dot.h"
using namespace moejax;
int main() {
  const int64_t len = 2048, rows = (1536LL << 20) / (len * 2);
  std::vector<uint16_t> w(rows * len);
  for (int64_t i = 0; i < rows * len; ++i) w[i] = 0x3c00 + (i % 64);
  std::vector<float> xf(len); std::vector<uint16_t> xb(len);
  for (int64_t i = 0; i < len; ++i) { xf[i] = to_f32(uint16_t(0x3f80 + i % 7)); xb[i] = 0x3f80 + i % 7; }
  std::vector<float> out(rows);
  auto run = [&](int mode, int threads) {
    auto body = [&](int64_t r0, int64_t r1) {
      if (mode == 0) rows_dot(w.data() + r0 * len, r1 - r0, len, xf.data(), 1, out.data() + r0, 1);
      else if (mode == 1) rows_dot(w.data() + r0 * len, r1 - r0, len, xb.data(), 1, out.data() + r0, 1);
      else if (mode == 2) for (int64_t r = r0; r + 2 <= r1; r += 2) micro<2, 1>(w.data() + r * len, xb.data(), len, out.data() + r, 1);
      else for (int64_t r = r0; r + 2 <= r1; r += 2) micro<2, 1>(w.data() + r * len, xf.data(), len, out.data() + r, 1);
    };
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      auto t = std::chrono::steady_clock::now();
      std::vector<std::thread> th;
      for (int i = 0; i < threads; ++i) th.emplace_back(body, rows * i / threads, rows * (i + 1) / threads);
      for (auto& x : th) x.join();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }
    return rows * len * 2 / best / 1e9;
  };
  const char* names[] = {"widened (f32 token)", "bf16 pairs", "pairs, 2 rows at once", "widened, 2 rows at once"};
  for (int m = 0; m < 4; ++m) printf("%-26s 1 thread %5.1f GB/s, 2 threads %5.1f GB/s\n", names[m], run(m, 1), run(m, 2));
}
