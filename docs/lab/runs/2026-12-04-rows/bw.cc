// Read bandwidth of four matvec inner loops over 1.5 GiB of f32 rows (cycled, so caches do
// not help), 1 and 2 threads: g++ -O3 -march=native -std=c++17 -pthread bw.cc -o bw && ./bw
// (docs/speed.md, "One row at a time").
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <thread>
#include <vector>
#include <atomic>
typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
// current: 4 rows at once, one accumulator each
void rows4(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r + 4 <= rows; r += 4) {
    v8f a[4] = {};
    for (int64_t d = 0; d < len; d += 8) { v8f xv = load8(x + d);
      for (int i = 0; i < 4; ++i) a[i] += load8(w + (r + i) * len + d) * xv; }
    for (int i = 0; i < 4; ++i) out[r + i] = hsum(a[i]);
  }
}
// 4 rows, 2 accumulators each (16 floats per row per step)
void rows4x2(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r + 4 <= rows; r += 4) {
    v8f a[4] = {}, b[4] = {};
    for (int64_t d = 0; d < len; d += 16) { v8f xv = load8(x + d), xw = load8(x + d + 8);
      for (int i = 0; i < 4; ++i) { a[i] += load8(w + (r + i) * len + d) * xv; b[i] += load8(w + (r + i) * len + d + 8) * xw; } }
    for (int i = 0; i < 4; ++i) out[r + i] = hsum(a[i] + b[i]);
  }
}
// one row, 4 accumulators (ggml style)
void rows1x4(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    v8f a[4] = {}; const float* wr = w + r * len;
    for (int64_t d = 0; d < len; d += 32) for (int i = 0; i < 4; ++i) a[i] += load8(wr + d + 8 * i) * load8(x + d + 8 * i);
    out[r] = hsum((a[0] + a[1]) + (a[2] + a[3]));
  }
}
void rows1x1(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    v8f a = {}; const float* wr = w + r * len;
    for (int64_t d = 0; d < len; d += 8) a += load8(wr + d) * load8(x + d);
    out[r] = hsum(a);
  }
}
void rows2(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; r += 2) {
    v8f a = {}, b = {}; const float* wr = w + r * len;
    for (int64_t d = 0; d < len; d += 8) { v8f xv = load8(x + d); a += load8(wr + d) * xv; b += load8(wr + len + d) * xv; }
    out[r] = hsum(a); out[r + 1] = hsum(b);
  }
}
// current + prefetch of the rows 4 ahead
void rows4p(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r + 4 <= rows; r += 4) {
    v8f a[4] = {};
    for (int64_t d = 0; d < len; d += 8) { v8f xv = load8(x + d);
      if ((d & 15) == 0) for (int i = 0; i < 4; ++i) __builtin_prefetch(w + (r + 4 + i) * len + d, 0, 0);
      for (int i = 0; i < 4; ++i) a[i] += load8(w + (r + i) * len + d) * xv; }
    for (int i = 0; i < 4; ++i) out[r + i] = hsum(a[i]);
  }
}
int main(int argc, char** argv) {
  const int64_t len = 512, rows_per = 1024;  // a 2 MB matrix (like a gate_up of 2I=512 ... )
  const int64_t nmat = 768;                  // 1.5 GiB
  std::vector<float> w(nmat * rows_per * len, 0.001f), x(len, 1.0f), out(rows_per * 2);
  using F = void (*)(const float*, int64_t, int64_t, const float*, float*);
  F fs[] = {rows4, rows1x4, rows1x1, rows2}; const char* names[] = {"rows4", "rows1x4", "rows1x1", "rows2"};
  for (int threads : {1, 2}) for (int rep = 0; rep < 2; ++rep) for (int f = 0; f < 4; ++f) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
      for (int64_t m = 0; m < nmat; ++m) {
        const int64_t half = rows_per / threads;
        fs[f](&w[(m * rows_per + t * half) * len], half, len, x.data(), &out[t * half]);
      }});
    for (auto& th : ts) th.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%d threads %-8s %.1f GB/s\n", threads, names[f], w.size() * 4 / s / 1e9);
  }
}
