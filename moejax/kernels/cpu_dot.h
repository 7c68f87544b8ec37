// The dot products of the CPU kernels (cpu_kernel.cc): out[t, r] = w[r, :] . x[t, :] over
// f32 or bf16 weight rows and f32 or bf16 activations, for one token (decode) or a prompt's
// block. Every (row, token) is summed the same way whatever the tile: chains of vector
// steps over the row's chunks (bf16 rows: four, chain k taking chunks k, k + 4, ...; f32
// rows: one), added pairwise, the lanes folded to 8 and added in hsum's fixed tree, then
// the tail in order. A step is a 16-lane (AVX-512) or 8-lane fused multiply-add of widened
// weights, or, for bf16 weights and a bf16 token on a CPU with AVX512-BF16, one vdpbf16ps
// over 32 bf16 pairs (Step). So a token's result has the same bits alone, in a prompt, or
// in any tile, on one machine; another instruction set gives other bits.
#ifndef MOEJAX_CPU_DOT_H_
#define MOEJAX_CPU_DOT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_bf16.h"
#include "cpu_prefetch.h"

namespace moejax {

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Eight bf16 as f32 (each the high half of its f32). With AVX2 it is one widening load
// (vpmovzxwd) and a shift: GCC lowers __builtin_convertvector of 8 x u16 to two 4-lane
// widenings, an insert and a shift, and that shuffle work, not the FMA chain, bounded a
// bf16 row's dot (docs/speed.md, "The bf16 widening"). Same values either way.
inline v8f load8(const uint16_t* p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  return reinterpret_cast<v8f>(_mm256_castsi256_ps(u));
#else
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// The dot products' vector: 16 lanes (one zmm) where the compiler targets AVX-512, else
// 8.  Zen 5 and recent Intel cores run 512-bit FMAs at full width, so 16 lanes halve the
// instructions per weight byte (a decoded row's widen + shift + FMA, a prompt tile's FMAs).
// A row's sum depends on the lane count (its chunks are kLanes elements), so a library
// built for AVX-512 and one built for AVX2 give different bits; on one machine every path
// uses the one micro below, so a token's bits do not depend on the tile or the call.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vecf __attribute__((vector_size(kLanes * 4)));

inline vecf loadv(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vecf loadv(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vecf>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#else
  return load8(p);
#endif
}
inline vecf fmav(vecf a, vecf b, vecf c);
// A vector's lanes folded to 8 (lane i + lane i + 8), then hsum's tree.
inline v8f fold8(vecf v) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}

typedef float v4f __attribute__((vector_size(16)));

// Chains of vector steps a row's dot keeps: chain k takes the chunks (Step::kChunk
// elements) k, k + C, k + 2C, ... in order; the chains are then added pairwise
// (chains_sum).  Four for bf16 rows: on the 8-lane build one chain's FMA latency (16 bytes
// of weights an FMA) bounded a decoded row, not memory.  One for f32 rows (32 bytes an FMA: memory bounds them), whose
// prompt tiles (8 rows of 8 KB at Qwen3-30B-A3B's width) would not stay in L1 over four
// passes: 4096 x 2048 f32 over 8 tokens took 3.3-3.4 ms with four, 1.6-2.0 with one.
template <typename W>
constexpr int kChains = sizeof(W) == 2 ? 4 : 1;
template <int C, int R, int T>
inline vecf chains_sum(const vecf (&a)[C][R][T], int r, int t) {
  if constexpr (C == 1) return a[0][r][t];
  else if constexpr (C == 2) return a[0][r][t] + a[1][r][t];
  else return (a[0][r][t] + a[1][r][t]) + (a[2][r][t] + a[3][r][t]);
}

// a * b + c, fused where the CPU has FMA.  Written out rather than left to the compiler's
// contraction (-ffp-contract=fast), which fused the scalar tail in some tile shapes and
// not in others, so the same (row, token) came out with different bits.
inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return reinterpret_cast<v8f>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                               reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}
inline vecf fmav(vecf a, vecf b, vecf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#else
  return fma8(a, b, c);
#endif
}
// Whether bf16 weights meet a bf16 token as bf16 pairs (AVX512-BF16's vdpbf16ps, as
// llama.cpp's bf16 dot): each lane adds a chunk's pair (2i, 2i + 1) of exact products,
// 32 elements an instruction, with no widening of the weights.  Used where the token is
// bf16 anyway (a bf16 model's projections and gate/up rows), so no precision is lost
// against widening it; the sums differ from the widened path's in their order (and the
// instruction flushes denormals), so on one machine every bf16-token dot takes it.
#if defined(__AVX512BF16__)
constexpr bool kPairs = true;
inline vecf pairs_step(vecf acc, const uint16_t* w, const uint16_t* x) {
  return reinterpret_cast<vecf>(_mm512_dpbf16_ps(
      reinterpret_cast<__m512>(acc),
      reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)),
      reinterpret_cast<__m512bh>(_mm512_loadu_si512(x))));
}
#else
constexpr bool kPairs = false;
#endif

// One chunk of a dot: kLanes elements widened to f32 and fused (f32 tokens), or 32 bf16
// pairs (bf16 tokens where kPairs).
template <typename W, typename X>
struct Step {
  static constexpr int kChunk = kLanes;
  static vecf x(const X* p) { return loadv(p); }
  static vecf apply(vecf acc, const W* w, vecf xv) { return fmav(loadv(w), xv, acc); }
};
#if defined(__AVX512BF16__)
template <>
struct Step<uint16_t, uint16_t> {
  static constexpr int kChunk = 32;
  static const uint16_t* x(const uint16_t* p) { return p; }
  static vecf apply(vecf acc, const uint16_t* w, const uint16_t* xp) {
    return pairs_step(acc, w, xp);
  }
};
#endif

inline float fma1(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// The horizontal sums of four accumulators, each added as hsum adds it (same bits):
// (a0 + a4, a1 + a5, a2 + a6, a3 + a7), then pairs, then the two halves.
inline v4f hsum4(v8f a, v8f b, v8f c, v8f d) {
  auto fold = [](v8f v) -> v4f {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  };
  auto pairs = [](v4f u, v4f v) -> v4f {
    return __builtin_shufflevector(u, v, 0, 2, 4, 6) + __builtin_shufflevector(u, v, 1, 3, 5, 7);
  };
  return pairs(pairs(fold(a), fold(b)), pairs(fold(c), fold(d)));
}

// out[t * os + r] = dot(w[r, :], x[t, :]) for R rows and T tokens; w rows and x rows
// both have `len` contiguous elements.  Every (row, token) is summed the same way for any
// R and T: kChains kLanes-wide accumulators over the row's kLanes-element chunks
// (chains_sum), the lanes folded to 8 (fold8), then hsum's tree, then the tail in order
// (docs/lab/runs/2026-12-06-engine4-chains).  A tile of up to two (row, token) pairs keeps
// every chain live in one pass over the row; a prompt's larger tile runs one pass a chain
// with R x T live accumulators (the registers hold no more).  R a multiple of 4 sums four
// rows' lanes at once (hsum4).
template <int R, int T, typename W, typename X>
inline void micro(const W* w, const X* x, int64_t len, float* out, int64_t os) {
  using S = Step<W, X>;
  constexpr int C = kChains<W>, L = S::kChunk;
  const int64_t nc = len / L, d = nc * L;
  v8f sum[R][T];
  if constexpr (R * T * C <= 8) {   // every chain live: one pass over the row
    vecf a[C][R][T];
    for (int k = 0; k < C; ++k)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) a[k][r][t] = vecf{};
    int64_t c = 0;
    for (; c + C <= nc; c += C) {
      prefetch_next_rows<R, T, C * L * sizeof(W)>(reinterpret_cast<const uint8_t*>(w + c * L),
                                                  len * sizeof(W));
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < C; ++k) {
          const auto xv = S::x(x + t * len + (c + k) * L);
          for (int r = 0; r < R; ++r)
            a[k][r][t] = S::apply(a[k][r][t], w + r * len + (c + k) * L, xv);
        }
    }
    for (int k = 0; k < C && c < nc; ++c, ++k)   // fewer than C chunks left
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r)
          a[k][r][t] = S::apply(a[k][r][t], w + r * len + c * L, S::x(x + t * len + c * L));
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) sum[r][t] = fold8(chains_sum(a, r, t));
  } else {   // one pass a chain, R x T accumulators live (a prompt's tile)
    vecf a[C][R][T];
    for (int k = 0; k < C; ++k) {
      vecf acc[R][T];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = vecf{};
      for (int64_t c = k; c < nc; c += C) {
        decltype(S::x(x)) xv[T];
        for (int t = 0; t < T; ++t) xv[t] = S::x(x + t * len + c * L);
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < T; ++t) acc[r][t] = S::apply(acc[r][t], w + r * len + c * L, xv[t]);
      }
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) a[k][r][t] = acc[r][t];
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) sum[r][t] = fold8(chains_sum(a, r, t));
  }
  float s[T][R];
  for (int t = 0; t < T; ++t) {
    if constexpr (R % 4 == 0) {
      for (int r = 0; r < R; r += 4) {
        const v4f q = hsum4(sum[r][t], sum[r + 1][t], sum[r + 2][t], sum[r + 3][t]);
        std::memcpy(&s[t][r], &q, sizeof(q));
      }
    } else {
      for (int r = 0; r < R; ++r) s[t][r] = hsum(sum[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float v = s[t][r];
      for (int64_t j = d; j < len; ++j) v = fma1(to_f32(w[r * len + j]), to_f32(x[t * len + j]), v);
      out[t * os + r] = v;
    }
}

// dot(w[:len], x[:len]) of one row, summed as micro sums it.
template <typename W>
inline float dot_row(const W* w, const float* x, int64_t len) {
  float s;
  micro<1, 1>(w, x, len, &s, 0);
  return s;
}

template <int R, typename W, typename X>
inline void micro_t(const W* w, const X* x, int64_t len, int64_t nt, float* out,
                    int64_t os) {
  switch (nt) {
    case 1: micro<R, 1>(w, x, len, out, os); break;
    case 2: micro<R, 2>(w, x, len, out, os); break;
    case 3: micro<R, 3>(w, x, len, out, os); break;
    case 4: micro<R, 4>(w, x, len, out, os); break;
    case 5: micro<R, 5>(w, x, len, out, os); break;
    case 6: micro<R, 6>(w, x, len, out, os); break;
    case 7: micro<R, 7>(w, x, len, out, os); break;
    default: micro<R, 8>(w, x, len, out, os); break;
  }
}

// out[t, r] (row stride os) = w[r, :] . x[t, :] for all rows and nt tokens.
// One token (decode) reads bf16 rows one after another: four rows interleaved read at about
// half the bandwidth on the 2-core EPYC VM (docs/speed.md, "One row at a time"); their
// four chains hide the FMA latency.  An f32 row keeps one chain, so four f32 rows run
// interleaved instead (the same sums: a 32 MB f32 matrix 0.79-0.86 -> 0.44-0.52 ms).  More
// tokens (a prompt's block) run in tiles of 8 rows x 2 tokens, which keep both FMA units
// busy (docs/speed.md, "Prompt tiles").  micro sums every (row, token) the same way for
// any tile, so the bits do not depend on the tile or on how many tokens a call has.
template <typename W, typename X>
void rows_dot(const W* w, int64_t rows, int64_t len, const X* x, int64_t nt, float* out,
              int64_t os) {
  if (nt == 1) {
    int64_t r = 0;
    if constexpr (kChains<W> == 1)   // f32: four rows' chains interleaved hide the FMA latency
      for (; r + 4 <= rows; r += 4) micro<4, 1>(w + r * len, x, len, out + r, os);
    for (; r < rows; ++r) micro<1, 1>(w + r * len, x, len, out + r, os);
    return;
  }
  // f32: 8 rows x 2 tokens; bf16: 4 rows x 8 tokens with 8 lanes, fewer weight conversions
  // per FMA; 8 x 3 with 16 lanes, whose 24 accumulators, 3 tokens and a row fit AVX-512's
  // 32 registers (4 x 8 spilled: a 4096 x 2048 linear over 64 tokens 3.5-3.8 ms against
  // 3.0; docs/lab/runs/2026-12-06-avx512)
  constexpr int64_t kR = sizeof(W) == 4 ? 8 : (kLanes == 16 ? 8 : 4);
  constexpr int64_t kT = sizeof(W) == 4 ? 2 : (kLanes == 16 ? 3 : 8);
  int64_t r = 0;
  for (; r + kR <= rows; r += kR)
    for (int64_t t = 0; t < nt; t += kT)
      micro_t<kR>(w + r * len, x + t * len, len, std::min(kT, nt - t), out + t * os + r, os);
  for (; r + 4 <= rows; r += 4)
    for (int64_t t = 0; t < nt; t += kT)
      micro_t<4>(w + r * len, x + t * len, len, std::min(kT, nt - t), out + t * os + r, os);
  for (; r < rows; ++r)
    for (int64_t t = 0; t < nt; t += kT)
      micro_t<1>(w + r * len, x + t * len, len, std::min(kT, nt - t), out + t * os + r, os);
}

}  // namespace moejax

#endif  // MOEJAX_CPU_DOT_H_
