// Dots of Q8_0 / Q4_0 weight rows (GGUF blocks of 32, cpu_qact.h) with quantized tokens
// (QAct, blocks of 32), ggml's vec_dot_q8_0_q8_0 / vec_dot_q4_0_q8_0 approach: per block an
// exact integer dot of the codes, then the block's scales in f32.
//
//  - AVX-512 VNNI + VBMI (decode: one token, up to 4 rows; a prompt's tokens go through
//    cpu_qpanel.h). Four blocks (a group) a step: vpdpbusd multiplies unsigned weight
//    bytes by signed token codes, four a lane: Q4_0's codes 0..15 as they are, Q8_0's
//    int8 with 128 added (xor 0x80); the lanes start at the token's -offset * the sum of
//    their codes (QAct::corr), so a block's lanes add up to its exact sum of
//    (w - offset) * x. Byte and word permutes pick the group's codes and f16 scales out of
//    the row's bytes. The 4 rows' lanes are then added per block (sum_fours), so a lane
//    holds one row, and per block acc = fma(float(isum), d_w * d_x, acc): the sequence of
//    cpu_qpanel.h's prompt dots, so a token has the same bits alone or in a prompt.
//  - AVX2: one block a step in one ymm, as ggml's AVX2 path: vpmaddubsw of |w| and
//    sign(x, w) (Q8_0) or of the 0..15 codes (Q4_0, then the offset), vpmaddwd to int32;
//    each (row, token) runs the same instructions whatever the tile<R, T> it lands in.
//  - elsewhere: scalar, per block.
// A build for another instruction set sums in other lanes: other bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_prefetch.h"
#include "cpu_qact.h"

namespace moejax {

// Which instructions the quantized dots use here (for describe()).
inline const char* qdot_isa() {
#if defined(MOEJAX_QDOT_VNNI512)
  return "avx512-vnni";
#elif defined(MOEJAX_QDOT_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#if defined(MOEJAX_QDOT_VNNI512)

// Byte / word indices (vpermt2b, vpermt2w) that pick a group of 4 blocks' codes and
// scales out of the 128 bytes (two zmm) they start in.
struct Idx32 {
  alignas(64) uint8_t q4_codes[64];    // Q4_0: the 4 blocks' 16 code bytes
  alignas(64) uint16_t q4_scales[32];  // Q4_0: words 0-15 = d0 x 4, d1 x 4, d2 x 4, d3 x 4
  alignas(64) uint8_t q8_codes01[64];  // Q8_0: blocks 0, 1's 32 codes (from bytes 0-127)
  alignas(64) uint8_t q8_codes23[64];  // Q8_0: blocks 2, 3's (from bytes 64-191)
  alignas(64) uint16_t q8_scales[32];  // Q8_0: d0 x 8, d1 x 8, d2 x 8, d3 x 8
  alignas(64) int32_t q8_rows[16];     // Q8_0: lane 4b + r <- rows' scales of block b
  alignas(64) int32_t q8_xd[16];       // Q8_0: lane 4b + r <- the token's d of block b
  Idx32() {
    for (int l = 0; l < 16; ++l) {
      q8_rows[l] = 16 * (l / 8) + 8 * ((l / 4) % 2) + l % 4;
      q8_xd[l] = 8 * (l / 4);
    }
    for (int i = 0; i < 64; ++i) {
      q4_codes[i] = static_cast<uint8_t>(2 + 18 * (i / 16) + i % 16);
      q8_codes01[i] = static_cast<uint8_t>(2 + 34 * (i / 32) + i % 32);
      q8_codes23[i] = static_cast<uint8_t>(2 + 68 - 64 + 34 * (i / 32) + i % 32);
    }
    for (int i = 0; i < 32; ++i) {
      q4_scales[i] = static_cast<uint16_t>(i < 16 ? 9 * (i / 4) : 0);
      q8_scales[i] = static_cast<uint16_t>(17 * (i / 8));
    }
  }
};
inline const Idx32& idx32() {
  static const Idx32 idx;
  return idx;
}
inline __m512i load_idx(const void* p) { return _mm512_load_si512(p); }
// The first n (clamped to 0-64) bytes of p, the rest zero (no read past them).
inline __m512i load_upto(const uint8_t* p, int64_t n) {
  const __mmask64 m = n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1;
  return _mm512_maskz_loadu_epi8(m, p);
}

// 4 vectors' lanes added in fours (exact integers): lane j of chunk c of the result is
// the sum of chunk c's 4 lanes of v[j].
inline __m512i sum_fours(const __m512i (&v)[4]) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}
// Lane 4b + r: lane 4b + r of v[r] (v[r]'s lanes 4b .. 4b + 3 hold one value of row r).
inline __m512 pick_rows(const __m512 (&v)[4]) {
  __m512 o = _mm512_mask_mov_ps(v[0], 0x2222, v[1]);
  o = _mm512_mask_mov_ps(o, 0x4444, v[2]);
  return _mm512_mask_mov_ps(o, 0x8888, v[3]);
}
// acc (lane r: row r) = fma(isum[b, r], prod[b, r], acc) for the group's blocks in order,
// chunk b of isum and prod holding block b.
__attribute__((always_inline)) inline __m128 fma_blocks(__m512i isum, __m512 prod, int64_t nblk,
                                                         __m128 acc) {
  const __m512 f = _mm512_cvtepi32_ps(isum);
  acc = _mm_fmadd_ps(_mm512_castps512_ps128(f), _mm512_castps512_ps128(prod), acc);
  if (nblk > 1) acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 1), _mm512_extractf32x4_ps(prod, 1), acc);
  if (nblk > 2) acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 2), _mm512_extractf32x4_ps(prod, 2), acc);
  if (nblk > 3) acc = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 3), _mm512_extractf32x4_ps(prod, 3), acc);
  return acc;
}

// One group (4 blocks, `left` of its bytes in the row: fewer in a last group, which then
// reads zeros past the row) of R <= 4 rows against one token. Each row's blocks' exact
// integer sums (vpdpbusd into lanes, the lanes of a block then added), then per block
// acc = fma(float(isum), d_w * d_x, acc): the sequence cpu_qpanel.h's prompt dots run.
template <int Q, int R>
__attribute__((always_inline)) inline __m128 group32(
    const uint8_t* w, int64_t row_bytes, int64_t left, const int8_t* xq, const int32_t* xc,
    const float* xv, __m128 acc) {
  const Idx32& ix = idx32();
  __m512i s0[4], s1[4];   // Q4_0: the 4 blocks' lanes; Q8_0: blocks 0-1, 2-3
  __m512 d0[4], d1[4];
  prefetch_next_rows<R, 1, Q == kQ8_0 ? 136 : 72>(w, row_bytes);
  const __m512i y0 = _mm512_loadu_si512(xq), y1 = _mm512_loadu_si512(xq + 64);
  const __m512i i0 = _mm512_loadu_si512(xc);
  for (int r = 0; r < 4; ++r) {
    if (r >= R) {
      s0[r] = s1[r] = _mm512_setzero_si512();
      d0[r] = d0[0];
      d1[r] = d1[0];
      continue;
    }
    const uint8_t* p = w + r * row_bytes;
    const __m512i A = load_upto(p, left), B = load_upto(p + 64, left - 64);
    if constexpr (Q == kQ4_0) {
      const __m512i qs = _mm512_permutex2var_epi8(A, load_idx(ix.q4_codes), B);
      const __m512i c0 = _mm512_and_si512(qs, _mm512_set1_epi8(0x0f));
      const __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(qs, 4), _mm512_set1_epi8(0x0f));
      d0[r] = _mm512_cvtph_ps(_mm512_castsi512_si256(   // the 4 scales lie in A
          _mm512_permutexvar_epi16(load_idx(ix.q4_scales), A)));
      d1[r] = d0[r];
      s0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0, c0, y0), c1, y1);
    } else {
      const __m512i C = load_upto(p + 128, left - 128);
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      const __m512i c0 = _mm512_xor_si512(_mm512_permutex2var_epi8(A, load_idx(ix.q8_codes01), B), flip);
      const __m512i c1 = _mm512_xor_si512(_mm512_permutex2var_epi8(B, load_idx(ix.q8_codes23), C), flip);
      const __m512i s = _mm512_permutex2var_epi16(A, load_idx(ix.q8_scales), B);
      d0[r] = _mm512_cvtph_ps(_mm512_castsi512_si256(s));
      d1[r] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(s, 1));
      s0[r] = _mm512_dpbusd_epi32(i0, c0, y0);
      s1[r] = _mm512_dpbusd_epi32(_mm512_loadu_si512(xc + 16), c1, y1);
    }
  }
  const int64_t nblk = std::min<int64_t>(4, (left + (Q == kQ8_0 ? 33 : 17)) / (Q == kQ8_0 ? 34 : 18));
  if constexpr (Q == kQ4_0) {   // chunk b, lane r: block b of row r; the scales spread as dv
    const __m512 prod = _mm512_mul_ps(pick_rows(d0), _mm512_loadu_ps(xv));
    return fma_blocks(sum_fours(s0), prod, nblk, acc);
  } else {   // blocks 0-1 of each row in s0 (8 lanes a block), 2-3 in s1
    const __m512i x0 = sum_fours(s0), x1 = sum_fours(s1);
    const __m512i y01 = _mm512_add_epi32(x0, _mm512_shuffle_i32x4(x0, x0, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i y23 = _mm512_add_epi32(x1, _mm512_shuffle_i32x4(x1, x1, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i isum = _mm512_shuffle_i32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 dw = _mm512_permutex2var_ps(pick_rows(d0), load_idx(ix.q8_rows), pick_rows(d1));
    const __m512 dx = _mm512_permutex2var_ps(_mm512_loadu_ps(xv), load_idx(ix.q8_xd),
                                             _mm512_loadu_ps(xv + 16));
    return fma_blocks(isum, _mm512_mul_ps(dw, dx), nblk, acc);
  }
}

// out[r] = w[r] . x[tok[0]] for R <= 4 rows (row_bytes apart) and one token, a group of
// four blocks a step: their codes and scales picked out of two or three zmm loads by
// byte/word permutes; the token's codes, spread scales and accumulator starts as
// qact_layout stored them. A prompt's tokens go through cpu_qpanel.h (the same bits).
template <int Q, int R, int T>
inline void tile32(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                   float* out, int64_t os) {
  static_assert(T == 1 && R <= 4, "AVX-512: one token, at most 4 rows (cpu_qpanel.h for more)");
  constexpr int64_t kBytes = Q == kQ8_0 ? 34 : 18, kGroup = 4 * kBytes;
  constexpr int64_t kVec = Q == kQ8_0 ? 32 : 16;   // corr / dv entries a group
  const int64_t ng = a.stride / 128, nbytes = a.len / 32 * kBytes, full = nbytes / kGroup;
  const int8_t* xq = a.q_of(tok[0]);
  const int32_t* xc = a.corr_of(tok[0]);
  const float* xv = a.dv_of(tok[0]);
  __m128 acc = _mm_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    if (g < full) acc = group32<Q, R>(w + g * kGroup, row_bytes, kGroup, xq, xc, xv, acc);
    else acc = group32<Q, R>(w + g * kGroup, row_bytes, nbytes - g * kGroup, xq, xc, xv, acc);
    xq += 128;
    xc += kVec;
    xv += kVec;
  }
  alignas(16) float o[4];
  _mm_store_ps(o, acc);
  for (int r = 0; r < R; ++r) out[r] = o[r];
  (void)os;
}

#elif defined(MOEJAX_QDOT_AVX2)

// The 8 lanes of v added in a fixed tree.
inline float hsum8i(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

template <int Q, int R, int T>
inline void tile32(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                   float* out, int64_t os) {
  constexpr int64_t kBytes = Q == kQ8_0 ? 34 : 18;
  const int64_t nb = a.len / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[R];
    __m256 wd[R];
    if (b % 2 == 0) prefetch_next_rows<R, T, 2 * kBytes>(w + b * kBytes, row_bytes);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * kBytes;
      uint16_t h;
      std::memcpy(&h, blk, 2);
      wd[r] = _mm256_set1_ps(_cvtsh_ss(h));
      if constexpr (Q == kQ8_0) {
        wq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
        wq[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                 _mm256_set1_epi8(0x0f));
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          a.q_of(tok[t]) + b * 32));
      const __m256 xd = _mm256_set1_ps(a.d_of(tok[t])[b]);
      __m256i init = _mm256_setzero_si256();   // Q4_0: -8 * the sums of 4 codes
      if constexpr (Q == kQ4_0)
        init = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr_of(tok[t]) + b * 8));
      for (int r = 0; r < R; ++r) {
        __m256i p;
        if constexpr (Q == kQ8_0)   // |w| * sign(x, w): products within int16
          p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq[r], wq[r]), _mm256_sign_epi8(xq, wq[r]));
        else
          p = _mm256_maddubs_epi16(wq[r], xq);
        const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(p, ones), init);
        acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), wd[r]), xd,
                                    acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * os + r] = hsum8i(acc[r][t]);
}

#else

template <int Q, int R, int T>
inline void tile32(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                   float* out, int64_t os) {
  constexpr int64_t kBytes = Q == kQ8_0 ? 34 : 18;
  const int64_t nb = a.len / 32;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const uint8_t* row = w + r * row_bytes;
      const int8_t* xq = a.q_of(tok[t]);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kBytes;
        int32_t isum = 0;
        for (int j = 0; j < 32; ++j) {
          const int wv = Q == kQ8_0 ? static_cast<int8_t>(blk[2 + j])
                                    : ((j < 16 ? blk[2 + j] : blk[2 + j - 16] >> 4) & 15) - 8;
          isum += wv * xq[b * 32 + j];
        }
        acc = std::fma(static_cast<float>(isum) * half_at(blk), a.d_of(tok[t])[b], acc);
      }
      out[t * os + r] = acc;
    }
}

#endif

}  // namespace moejax
