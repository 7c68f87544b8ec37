// One token's dot over rows of bf16 or f32 weights (f32 activations), from a working set of
// 1, 4, 16 and 1024 MiB, with 1, 2 or 4 FMA chains per row (c1 is what the kernels do);
// GB/s of weights read, best of 3, one thread (docs/speed.md, "The bf16 widening"):
//   g++ -O3 -march=native -std=c++17 chains.cc -o chains && ./chains
//   g++ -O3 -march=native -std=c++17 -DCONVERTVECTOR chains.cc -o chains_cv && ./chains_cv
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <vector>
#include <immintrin.h>
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
#ifdef CONVERTVECTOR  // the kernels' widening before this change
inline v8f load8(const uint16_t* p) { v8h h; std::memcpy(&h, p, 16); v8u u = __builtin_convertvector(h, v8u) << 16; v8f v; std::memcpy(&v, &u, 32); return v; }
#else  // cpu_dot.h now: one vpmovzxwd and a shift
inline v8f load8(const uint16_t* p) { __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16); return (v8f)_mm256_castsi256_ps(u); }
#endif
inline v8f fma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
template <typename W> float dot1(const W* w, const float* x, int64_t len) {
  v8f a = {}; for (int64_t d = 0; d < len; d += 8) a = fma8(load8(w + d), load8(x + d), a); return hsum(a); }
template <typename W> float dot2(const W* w, const float* x, int64_t len) {
  v8f a = {}, b = {}; for (int64_t d = 0; d < len; d += 16) { a = fma8(load8(w + d), load8(x + d), a); b = fma8(load8(w + d + 8), load8(x + d + 8), b);} return hsum(a + b); }
template <typename W> float dot4(const W* w, const float* x, int64_t len) {
  v8f a = {}, b = {}, c = {}, e = {}; for (int64_t d = 0; d < len; d += 32) { a = fma8(load8(w + d), load8(x + d), a); b = fma8(load8(w + d + 8), load8(x + d + 8), b); c = fma8(load8(w + d + 16), load8(x + d + 16), c); e = fma8(load8(w + d + 24), load8(x + d + 24), e);} return hsum((a + b) + (c + e)); }
template <typename W, float (*D)(const W*, const float*, int64_t)>
void rows(const W* w, int64_t n, int64_t len, const float* x, float* out) { for (int64_t r = 0; r < n; ++r) out[r] = D(w + r * len, x, len); }
template <typename W> void run(const char* tn) {
  for (int64_t mb : {1, 4, 16, 1024}) for (int64_t len : {128, 512, 1024}) {
    const int64_t total = (mb << 20) / sizeof(W), nrows = total / len, reps = (int64_t(2) << 30) / (mb << 20);
    std::vector<W> w(total, W(1)); std::vector<float> x(len, 1.0f), out(nrows);
    using F = void (*)(const W*, int64_t, int64_t, const float*, float*);
    F fs[] = {rows<W, dot1<W>>, rows<W, dot2<W>>, rows<W, dot4<W>>};
    printf("%s %5ldMB len %4ld:", tn, (long)mb, (long)len);
    for (int f = 0; f < 3; ++f) { double best = 1e9; for (int rep = 0; rep < 3; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t k = 0; k < reps; ++k) fs[f](w.data(), nrows, len, x.data(), out.data());
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (s < best) best = s; }
      printf("  c%d %6.1f GB/s", 1 << f, double(mb << 20) * reps / best / 1e9); }
    printf("\n"); }
}
int main() { run<uint16_t>("bf16"); run<float>("f32 "); }
