// Dots of Q8_0 / Q4_0 weight rows (GGUF blocks of 32, cpu_qact.h) with quantized tokens
// (QAct, blocks of 32), ggml's vec_dot_q8_0_q8_0 / vec_dot_q4_0_q8_0 approach: per block an
// exact integer dot of the codes, then in f32 acc += (isum * d_w) * d_x.
//
//  - AVX-512 VNNI: two blocks a step in one zmm. vpdpbusd multiplies unsigned weight bytes
//    by signed token codes, four a lane: Q4_0's codes 0..15 as they are, Q8_0's int8 with
//    128 added (xor 0x80); the accumulator starts at the token's (-offset) * sum of each 4
//    codes (QAct::nls), so each lane holds the exact sum of (w - offset) * x.
//  - AVX2: one block a step in one ymm, as ggml's AVX2 path: vpmaddubsw of |w| and
//    sign(x, w) (Q8_0) or of the 0..15 codes (Q4_0, then the offset), vpmaddwd to int32.
//  - elsewhere: scalar, per block.
// Each (row, token) takes the same instructions in the same order whatever the tile
// (tile<R, T> only shares loads between them), so a token has the same bits alone or in
// a prompt. A build for another instruction set sums in other lanes: other bits.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_qact.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define MOEJAX_QDOT_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MOEJAX_QDOT_AVX2 1
#endif

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

// Two consecutive f32 (or f16) scales spread over a zmm's halves: lanes 0-7 the first.
inline __m512 spread2(__m128 s) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s));
}
// The weight scales of blocks b and b + 1 (the second 0 when there is none).
inline __m512 w_scales2(const uint8_t* b, int64_t bytes, bool two) {
  uint16_t h0, h1 = 0;
  std::memcpy(&h0, b, 2);
  if (two) std::memcpy(&h1, b + bytes, 2);
  return spread2(_mm_cvtph_ps(_mm_cvtsi32_si128(h0 | static_cast<uint32_t>(h1) << 16)));
}
// The codes of blocks b and b + 1 as unsigned bytes (the second zero when there is none).
template <int Q>
inline __m512i w_codes2(const uint8_t* b, bool two) {
  if constexpr (Q == kQ8_0) {   // int8 + 128
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m256i hi = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36))
                           : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {   // Q4_0: [low nibbles, high nibbles] of each block's 16 bytes
    const __m256i lo = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    const __m256i hi = two ? _mm256_broadcastsi128_si256(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 20)))
                           : _mm256_setzero_si256();
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    // 128-bit lanes 1 and 3 (16-bit words 8-15, 24-31) shifted to their high nibbles
    return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xff00ff00u, v, 4),
                            _mm512_set1_epi8(0x0f));
  }
}

// out[t * os + r] = w[r] . x[tok[t]] for R rows (row_bytes apart) and T tokens.
template <int Q, int R, int T>
inline void tile32(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                   float* out, int64_t os) {
  constexpr int64_t kBytes = Q == kQ8_0 ? 34 : 18;
  constexpr int kOffsetShift = Q == kQ8_0 ? 7 : 3;   // offset 128 or 8
  const int64_t nb = a.len / 32;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    __m512i wq[R];
    __m512 wd[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * kBytes;
      wq[r] = w_codes2<Q>(blk, two);
      wd[r] = w_scales2(blk, kBytes, two);
    }
    for (int t = 0; t < T; ++t) {
      const __m512i xq = _mm512_loadu_si512(a.q_of(tok[t]) + b * 32);
      const __m512i init = _mm512_slli_epi32(_mm512_loadu_si512(a.nls_of(tok[t]) + b * 8),
                                             kOffsetShift);
      const __m512 xd = spread2(_mm_castpd_ps(_mm_load_sd(
          reinterpret_cast<const double*>(a.d_of(tok[t]) + b))));
      for (int r = 0; r < R; ++r) {
        const __m512i isum = _mm512_dpbusd_epi32(init, wq[r], xq);
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), wd[r]), xd,
                                    acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * os + r] = _mm512_reduce_add_ps(acc[r][t]);
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
      __m256i init = _mm256_setzero_si256();
      if constexpr (Q == kQ4_0)
        init = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                     a.nls_of(tok[t]) + b * 8)), 3);
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
