// qrows_dot on prompt-like shapes, one thread, weights from L2: a prompt call against
// nt tokens, and the same rows token by token (decode), their bits compared.
//   g++ -O3 -march=native -std=c++17 -I moejax/kernels qprobe.cc -o qprobe
//   ./qprobe QTYPE ROWS COLS TOKENS REPS     (QTYPE 0 = Q8_0, 1 = Q4_0, 2 = Q4_K, 3 = Q6_K)
// (the K-quants' f16 scales set small, so that random codes stay finite)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "cpu_qrows.h"
using namespace moejax;
int main(int argc, char** argv) {
  int q = atoi(argv[1]); int64_t rows = atoll(argv[2]), cols = atoll(argv[3]), nt = atoll(argv[4]);
  int reps = atoi(argv[5]);
  int64_t bs = qblock_bytes(q), nb = cols / qblock_elems(q), rb = nb * bs;
  std::mt19937 g(1);
  std::vector<uint8_t> w(rows * rb);
  for (auto& b : w) b = g() & 255;
  for (int64_t r = 0; r < rows; ++r) for (int64_t b = 0; b < nb; ++b) {
    if (q <= 2) { _Float16 h = (_Float16)(0.01f + (g() % 100) * 1e-4f); memcpy(&w[r*rb + b*bs], &h, 2); }
    if (q == 2) { _Float16 h = (_Float16)(0.001f + (g() % 100) * 1e-5f); memcpy(&w[r*rb + b*bs + 2], &h, 2); }
    if (q == 3) { _Float16 h = (_Float16)(0.001f + (g() % 100) * 1e-5f); memcpy(&w[r*rb + b*bs + 208], &h, 2); }
  }
  QAct a; qact_reset(a, q, nt, cols);
  std::normal_distribution<float> nd;
  std::vector<float> x(cols);
  for (int64_t t = 0; t < nt; ++t) { for (auto& v : x) v = nd(g); qact_row(x.data(), a, t); }
  std::vector<int64_t> tok(nt); for (int64_t t = 0; t < nt; ++t) tok[t] = t;
  std::vector<float> out(nt * rows), one(rows);
  qrows_dot(q, w.data(), rows, rb, a, tok.data(), nt, out.data(), rows);
  int bad = 0;
  for (int64_t t = 0; t < nt; ++t) {
    qrows_dot(q, w.data(), rows, rb, a, tok.data() + t, 1, one.data(), rows);
    for (int64_t r = 0; r < rows; ++r) bad += memcmp(&one[r], &out[t*rows + r], 4) != 0;
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) qrows_dot(q, w.data(), rows, rb, a, tok.data(), nt, out.data(), rows);
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) for (int64_t t = 0; t < nt; ++t) qrows_dot(q, w.data(), rows, rb, a, tok.data()+t, 1, one.data(), rows);
  double dd = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() / reps / nt;
  double s = 0; for (float v : out) s += v;
  printf("q%d %ldx%ld nt=%ld: prompt %.1f us (%.1f GMAC/s)  decode/token %.1f us  mismatches %d  sum %.6f\n",
         q, rows, cols, nt, dt * 1e6, rows * cols * nt / dt / 1e9, dd * 1e6, bad, s);
}
