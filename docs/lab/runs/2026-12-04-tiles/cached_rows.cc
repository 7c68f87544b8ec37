// One token's matvec over f32 rows of 512 or 128, from a working set of TOTAL_BYTES (cycled):
// one row at a time (rows1) against 4 or 8 rows interleaved, 1 and 2 threads, GB/s
// (docs/speed.md, "Rows from the caches"). For 1, 4 and 16 MiB:
//   for MB in 1 4 16; do g++ -O3 -march=native -std=c++17 -pthread \
//     -DTOTAL_BYTES="(int64_t($MB)<<20)" cached_rows.cc -o cr && ./cr; done
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <thread>
#include <vector>
typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
void rows1(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    v8f a = {}; const float* wr = w + r * len;
    for (int64_t d = 0; d < len; d += 8) a += load8(wr + d) * load8(x + d);
    out[r] = hsum(a);
  }
}
template <int R>
void rowsR(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; r += R) {
    v8f a[R] = {};
    for (int64_t d = 0; d < len; d += 8) { v8f xv = load8(x + d);
      for (int i = 0; i < R; ++i) a[i] += load8(w + (r + i) * len + d) * xv; }
    for (int i = 0; i < R; ++i) out[r + i] = hsum(a[i]);
  }
}
template <int R, int AHEAD>
void rowsRp(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; r += R) {
    v8f a[R] = {};
    const char* pf = reinterpret_cast<const char*>(w + (r + AHEAD * R) * len);
    const int64_t lines = R * len * 4 / 64, steps = len / 8;
    int64_t l = 0;
    for (int64_t d = 0, s = 0; d < len; d += 8, ++s) { v8f xv = load8(x + d);
      for (; l < (s + 1) * lines / steps; ++l) __builtin_prefetch(pf + l * 64, 0, 3);
      for (int i = 0; i < R; ++i) a[i] += load8(w + (r + i) * len + d) * xv; }
    for (int i = 0; i < R; ++i) out[r + i] = hsum(a[i]);
  }
}
using F = void (*)(const float*, int64_t, int64_t, const float*, float*);
int main() {
  F fs[] = {rows1, rowsR<4>, rowsR<8>}; const char* names[] = {"rows1", "rows4", "rows8"};
  for (int64_t len : {512, 128}) {
    const int64_t rows_per = 1 << 20 / len * 2;  // 8 MB... 
    const int64_t total = TOTAL_BYTES / 4;
    std::vector<float> w(total, 0.001f), x(len, 1.0f), out(total / len);
    for (int threads : {1, 2}) for (int rep = 0; rep < 1; ++rep) for (int f = 0; f < 3; ++f) {
      auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> ts;
      const int64_t nrows = total / len, reps = (int64_t(1) << 30) / TOTAL_BYTES;
      for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
        const int64_t chunk = 128;  // rows per work piece, alternate between threads
        for (int64_t k = 0; k < reps; ++k)
        for (int64_t r0 = t * chunk; r0 < nrows; r0 += threads * chunk)
          fs[f](&w[r0 * len], chunk, len, x.data(), &out[r0]);
      });
      for (auto& th : ts) th.join();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      printf("%dMB", int(TOTAL_BYTES >> 20)); printf("  len %3ld %d thr %-6s %.1f GB/s\n", (long)len, threads, names[f], total * 4.0 * ((int64_t(1) << 30) / TOTAL_BYTES) / s / 1e9);
    }
  }
}
