// One thread's quantized dots outside XLA (issue 61's kernel work): qrows_dot (cpu_qrows.h)
// over `rows` random rows of 2048 elements per type, 1 token (decode) and 8, 64 tokens (prompt
// tiles), timed in the thread's CPU time (CLOCK_THREAD_CPUTIME_ID, so other jobs on the
// shared VM slow the wall clock, not the figure). Weight GB/s = row bytes / time.
//   g++ -O3 -march=native -std=c++17 -I moejax/kernels dots.cc -o dots && ./dots [rows] [reps]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cpu_qrows.h"

using namespace moejax;

static double cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? atoll(argv[1]) : 16384, c = 2048;
  const int reps = argc > 2 ? atoi(argv[2]) : 7;
  std::mt19937 gen(0);
  std::vector<float> x(64 * c);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(gen);
  const char* names[4] = {"q8_0", "q4_0", "q4_k", "q6_k"};
  for (int nt : {1, 8, 64}) {
    for (int round = 0; round < 2; ++round)
      for (int q = 0; q < 4; ++q) {
        const int64_t rb = c / qblock_elems(q) * qblock_bytes(q);
        std::vector<uint8_t> w(rows * rb);
        for (auto& b : w) b = gen();
        for (int64_t i = 0; i < rows * c / qblock_elems(q); ++i) {   // f16 scales 1e-3
          uint8_t* blk = w.data() + i * qblock_bytes(q);
          const uint16_t h = 0x1419;
          for (int at : {q == 3 ? 208 : 0, q == 2 ? 2 : -1})
            if (at >= 0) std::memcpy(blk + at, &h, 2);
        }
        QAct a;
        qact_reset(a, q, nt, c);
        for (int t = 0; t < nt; ++t) qact_row(x.data() + t * c, a, t);
        std::vector<int64_t> tok(nt);
        for (int t = 0; t < nt; ++t) tok[t] = t;
        std::vector<float> out(nt * rows);
        std::vector<double> ts;
        for (int r = 0; r < reps; ++r) {
          const double t0 = cpu_s();
          qrows_dot(q, w.data(), rows, rb, a, tok.data(), nt, out.data(), rows);
          ts.push_back(cpu_s() - t0);
        }
        std::sort(ts.begin(), ts.end());
        const double t = ts[reps / 2];
        if (round == 1)
          std::printf("%s tokens=%d  %8.3f ms  %6.2f GB/s  %6.1f GFLOP/s  (check %g)\n", names[q],
                      nt, t * 1e3, rows * rb / t / 1e9, 2.0 * nt * rows * c / t / 1e9, out[rows / 2]);
      }
  }
}
