// Prompt-path register tiles of the expert kernel's dot (rows x tokens), hot 512x512 and 512x256
// f32 weights, 32 tokens, one thread: the old 4x4 tile with a scalar horizontal sum per output
// (vec=0) against tiles whose four-row sums are added as vectors in the same order (vec=1).
// Prints GFLOP/s and whether the bits equal the 4x4 kernel's (docs/speed.md, "Prompt tiles").
//   g++ -O3 -march=native -std=c++17 tiles.cc -o tiles && ./tiles
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <immintrin.h>
typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
template <int R, int T>
inline void micro(const float* w, const float* x, int64_t len, float* out, int64_t os) {
  v8f acc[R][T];
  for (int r = 0; r < R; ++r) for (int t = 0; t < T; ++t) acc[r][t] = v8f{};
  for (int64_t d = 0; d + 8 <= len; d += 8) {
    v8f xv[T];
    for (int t = 0; t < T; ++t) xv[t] = load8(x + t * len + d);
    for (int r = 0; r < R; ++r) { v8f wv = load8(w + r * len + d); for (int t = 0; t < T; ++t) acc[r][t] += wv * xv[t]; }
  }
  for (int r = 0; r < R; ++r) for (int t = 0; t < T; ++t) out[t * os + r] = hsum(acc[r][t]);
}
// same bits: reduce 4 accumulators at once
inline __m128 hsum4(v8f a, v8f b, v8f c, v8f d) {
  __m256 A = (__m256)a, B = (__m256)b, C = (__m256)c, D = (__m256)d;
  __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(A), _mm256_extractf128_ps(A, 1)); // a0+a4,a1+a5,a2+a6,a3+a7
  __m128 b4 = _mm_add_ps(_mm256_castps256_ps128(B), _mm256_extractf128_ps(B, 1));
  __m128 c4 = _mm_add_ps(_mm256_castps256_ps128(C), _mm256_extractf128_ps(C, 1));
  __m128 d4 = _mm_add_ps(_mm256_castps256_ps128(D), _mm256_extractf128_ps(D, 1));
  __m128 ab = _mm_hadd_ps(a4, b4);  // a(0+1), a(2+3), b(0+1), b(2+3)
  __m128 cd = _mm_hadd_ps(c4, d4);
  return _mm_hadd_ps(ab, cd);       // a, b, c, d
}
template <int R, int T>
inline void micro4v(const float* w, const float* x, int64_t len, float* out, int64_t os) {
  v8f acc[R][T];
  for (int r = 0; r < R; ++r) for (int t = 0; t < T; ++t) acc[r][t] = v8f{};
  for (int64_t d = 0; d + 8 <= len; d += 8) {
    v8f xv[T];
    for (int t = 0; t < T; ++t) xv[t] = load8(x + t * len + d);
    for (int r = 0; r < R; ++r) { v8f wv = load8(w + r * len + d); for (int t = 0; t < T; ++t) acc[r][t] += wv * xv[t]; }
  }
  for (int r = 0; r < R; r += 4) for (int t = 0; t < T; ++t) _mm_storeu_ps(out + t * os + r, hsum4(acc[r][t], acc[r+1][t], acc[r+2][t], acc[r+3][t]));
}
template <int R, int T>
void rows(const float* w, int64_t nr, int64_t len, const float* x, int64_t nt, float* out, int64_t os, bool vec) {
  for (int64_t r = 0; r < nr; r += R)
    for (int64_t t = 0; t < nt; t += T) {
      if (vec) micro4v<R, T>(w + r * len, x + t * len, len, out + t * os + r, os);
      else micro<R, T>(w + r * len, x + t * len, len, out + t * os + r, os);
    }
}
int main() {
  const int64_t D = 512, I2 = 512, I = 256, NT = 32;
  std::vector<float> gu(I2 * D), dn(D * I), x(NT * D), a(NT * I), h(NT * I2), y(NT * D), h2(NT*I2), y2(NT*D);
  for (auto& v : gu) v = (rand() % 1000) / 1000.f - 0.5f;
  for (auto& v : dn) v = (rand() % 1000) / 1000.f - 0.5f;
  for (auto& v : x) v = (rand() % 1000) / 1000.f - 0.5f;
  for (auto& v : a) v = (rand() % 1000) / 1000.f - 0.5f;
  auto bench = [&](auto f, const char* name) { for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    const int iters = 400;
    for (int i = 0; i < iters; ++i) {
      f(gu.data(), I2, D, x.data(), NT, h2.data(), I2);
      f(dn.data(), D, I, a.data(), NT, y2.data(), D);
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double fl = 2.0 * NT * (I2 * D + D * I) * iters;
    printf("%s %.1f GFLOP/s\n", name, fl / s / 1e9);
  } };
  rows<4,4>(gu.data(), I2, D, x.data(), NT, h.data(), I2, false); rows<4,4>(dn.data(), D, I, a.data(), NT, y.data(), D, false);
#define B(R,T,V) bench([](const float* w, int64_t nr, int64_t len, const float* x, int64_t nt, float* o, int64_t os){ rows<R,T>(w,nr,len,x,nt,o,os,V);}, #R "x" #T " vec=" #V); printf("same %d %d\n", memcmp(h.data(), h2.data(), h.size()*4)==0, memcmp(y.data(), y2.data(), y.size()*4)==0);
  B(8,2,1) B(4,8,1) B(16,2,1) B(8,1,1) B(16,1,1) B(4,4,0) B(8,2,1) B(4,8,1)

  printf("same bits: %d %d\n", memcmp(h.data(), h2.data(), h.size()*4)==0, memcmp(y.data(), y2.data(), y.size()*4)==0);
}
