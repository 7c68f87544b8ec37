// Dots of Q4_K / Q6_K weight rows (GGUF super-blocks of 256, ggml-common.h's block_q4_K
// and block_q6_K) with tokens quantized in blocks of 256 (QAct, ggml's Q8_K), as ggml's
// vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K: per super-block an exact integer sum of the
// sub-blocks' dots times their integer scales, then in f32 acc += (isum * d - mins) * d_x.
//
//  Q4_K: 8 sub-blocks of 32, 4-bit codes, 6-bit scale sc and min m each;
//        value = d * sc * q - dmin * m. The mins' part is dmin * sum(m * sum of the
//        sub-block's token codes) (QAct::bsum), the rest sum(sc * dot(q, x)).
//  Q6_K: 16 sub-blocks of 16, 6-bit codes (offset 32), int8 scale each; value = d * sc * (q - 32).
//
// AVX-512 VNNI: vpdpbusd of 64 codes a step (unsigned codes, signed tokens; Q6_K's offset in
// the accumulator's start, QAct::corr); each lane's sum fits 16 bits, so two steps' sums
// are packed to words (vpackssdw) and one vpdpwssd multiplies them by the sub-blocks'
// scales: 4 vpdpbusd + 2 vpdpwssd a super-block. These are decode's tiles (a prompt goes
// by cpu_kpanel.h's panels): a row's lanes are added first and the f32 scales applied once
// per row and super-block, as the panels do. The scales unpack in vector registers, f16 by F16C. On one core from L2
// 1 token: Q4_K 15 -> 27 GB/s of blocks, Q6_K 28 -> 37 (Q4_0 27; dots.cc of
// docs/lab/runs/2026-12-07-kernels). AVX2: vpmaddubsw, then vpmaddwd by the scales.
// Elsewhere scalar.
// As in cpu_qdot.h, each (row, token) runs the same instructions whatever the tile.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_prefetch.h"
#include "cpu_qact.h"
#include "cpu_qdot.h"

namespace moejax {

// A Q4_K block's 12 bytes of 6-bit scales and mins unpacked (ggml's get_scale_min_k4).
inline void q4k_scales(const uint8_t* s12, uint8_t sc[8], uint8_t m[8]) {
  uint32_t u[3], o[4];
  std::memcpy(u, s12, 12);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  o[0] = u[0] & k1;                                         // sc 0-3: low 6 bits of 0-3
  o[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);          // sc 4-7: 8-11 low + 0-3 top
  o[2] = u[1] & k1;                                         // m 0-3: low 6 bits of 4-7
  o[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);   // m 4-7: 8-11 high + 4-7 top
  std::memcpy(sc, o, 8);
  std::memcpy(m, o + 2, 8);
}

#if defined(MOEJAX_QDOT_VNNI512)

// A Q4_K block's scales (bytes 0-7) and mins (bytes 8-15), q4k_scales in one xmm: the
// 16 bytes at s12 hold the 12 of the scales (and 4 of the codes, unused).
inline __m128i q4k_scales_v(const uint8_t* s12) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s12));
  const __m128i a = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0));   // u0 u2 u1 u2
  const __m128i b = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));   // u0 u0 u1 u1
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2),   // the top 2 bits to bits 4-5
                                   _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(lo, hi);
}

// Word indices (vpermw) of the sub-block scales for the words of packs(s0, s1), s0 and s1
// the dpbusd sums (16 int32 lanes) of chunks 2p and 2p + 1: in each 128-bit lane k, words
// 0-3 come from s0's lanes 4k .. 4k + 3, words 4-7 from s1's. Q4_K: chunk c's lanes 0-7
// are sub-block kQ4Sub[c][0], lanes 8-15 kQ4Sub[c][1]; Q6_K: chunk c's lane l sub-block
// 4c + l / 4.
// Lanes 0-7 take a's value, 8-15 b's.
inline __m512i halves_idx(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1);
}

struct KIdx {
  alignas(64) uint16_t q4[2][32], q6[2][32];
  KIdx() {
    static constexpr int kQ4Sub[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int p = 0; p < 2; ++p)
      for (int w = 0; w < 32; ++w) {
        const int k = w / 8, j = w % 8, c = 2 * p + j / 4, lane = 4 * k + j % 4;
        q4[p][w] = static_cast<uint16_t>(kQ4Sub[c][lane / 8]);
        q6[p][w] = static_cast<uint16_t>(4 * c + lane / 4);
      }
  }
};
inline const KIdx& kidx() {
  static const KIdx idx;
  return idx;
}

// The sum of a super-block's sub-block dots times their scales, added into isum: the
// chunks' dpbusd sums (each lane within int16) packed two by two to words, then vpdpwssd
// by the scales' words.
inline __m512i scaled_pair(__m512i isum, __m512i s0, __m512i s1, __m512i sv) {
  return _mm512_dpwssd_epi32(isum, _mm512_packs_epi32(s0, s1), sv);
}

// 4 f16 as f32, built in a register (not stored in pieces and loaded whole: a stall).
inline __m128 halves4(const uint16_t (&h)[4]) {
  return _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(h[0]), static_cast<short>(h[1]),
                                     static_cast<short>(h[2]), static_cast<short>(h[3]), 0, 0, 0, 0));
}

inline float hsum4(__m128 v) {
  const __m128 p = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// Q4_K, T <= 4 tokens against R <= 4 rows (a row's codes unpacked once for the tokens):
// per super-block, row and token 4 vpdpbusd (64 codes each)
// and 2 vpdpwssd by the sub-blocks' scales into 16 lanes whose sum is S = sum_j sc_j *
// dot_j; the mins' M = sum_j m_j * bsum_j in 4. The 4 rows' lanes are added (exact), then
// per super-block acc = fma(float(S), d * d_x, acc), accm = fma(float(M), dmin * d_x,
// accm) in one lane a row, and the result is acc - accm: cpu_kpanel.h's prompt sequence.
template <int R, int T>
inline void tile_q4k(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     float* out, int64_t os) {
  static_assert(R <= 4 && T <= 4, "AVX-512: at most 4 rows x 4 tokens (cpu_kpanel.h for more)");
  const int64_t nsb = a.len / 256;
  const KIdx& ix = kidx();
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m128 acc[T], accm[T];
  for (int t = 0; t < T; ++t) acc[t] = accm[t] = _mm_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    prefetch_next_rows<R, T, 144>(w + sb * 144, row_bytes);
    __m512i isum[4][T];
    __m128i m16[4];
    uint16_t dh[4] = {0, 0, 0, 0}, mh[4] = {0, 0, 0, 0};
    for (int r = 0; r < 4; ++r) {
      for (int t = 0; t < T; ++t) isum[r][t] = _mm512_setzero_si512();
      m16[r] = _mm_setzero_si128();
      if (r >= R) continue;
      const uint8_t* blk = w + r * row_bytes + sb * 144;
      std::memcpy(&dh[r], blk, 2);
      std::memcpy(&mh[r], blk + 2, 2);
      const __m128i scm = q4k_scales_v(blk + 4);   // scales (bytes 0-7), mins (8-15)
      m16[r] = _mm_cvtepu8_epi16(_mm_srli_si128(scm, 8));
      for (int p = 0; p < 2; ++p) {   // chunks 2p (low nibbles), 2p + 1 (high) of 64 bytes
        const __m512i raw = _mm512_loadu_si512(blk + 16 + 64 * p);
        const __m512i w0 = _mm512_and_si512(raw, nib);
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        const __m512i sv = _mm512_permutexvar_epi16(_mm512_load_si512(ix.q4[p]),
                                                    _mm512_castsi128_si512(_mm_cvtepu8_epi16(scm)));
        for (int t = 0; t < T; ++t) {
          const int8_t* xq = a.q_of(tok[t]) + sb * 256 + 128 * p;
          const __m512i x0 = _mm512_loadu_si512(xq), x1 = _mm512_loadu_si512(xq + 64);
          isum[r][t] = scaled_pair(isum[r][t], _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, x0),
                                   _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, x1), sv);
        }
      }
    }
    const __m128 d4 = halves4(dh), dm4 = halves4(mh);
    for (int t = 0; t < T; ++t) {
      const __m512i rows[4] = {isum[0][t], isum[1][t], isum[2][t], isum[3][t]};
      const __m512i v = sum_fours(rows);   // chunk c, lane r: a quarter of row r's S
      const __m512i h = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
      const __m512i u = _mm512_add_epi32(h, _mm512_shuffle_i32x4(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
      const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsum_of(tok[t]) + sb * 8));
      const __m128i m4 = _mm_hadd_epi32(
          _mm_hadd_epi32(_mm_madd_epi16(m16[0], bs), _mm_madd_epi16(m16[1], bs)),
          _mm_hadd_epi32(_mm_madd_epi16(m16[2], bs), _mm_madd_epi16(m16[3], bs)));
      const __m128 dx = _mm_set1_ps(a.d_of(tok[t])[sb]);
      acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm512_castsi512_si128(u)), _mm_mul_ps(d4, dx), acc[t]);
      accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(m4), _mm_mul_ps(dm4, dx), accm[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(16) float o[4];
    _mm_store_ps(o, _mm_sub_ps(acc[t], accm[t]));
    for (int r = 0; r < R; ++r) out[t * os + r] = o[r];
  }
}

// 64 of a Q6_K half's 128 codes: chunk 0 its elements 0-63, chunk 1 its elements 64-127.
inline __m512i q6k_codes(const uint8_t* ql, const uint8_t* qh, int chunk) {
  const __m512i l = _mm512_loadu_si512(ql);
  const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)));
  // the high 2 bits to bits 4-5: qh bits 0-1 / 2-3 (chunk 0), 4-5 / 6-7 (chunk 1)
  const __m512i hi2 = chunk ? _mm512_srlv_epi16(h, halves_idx(0, 0x00020002))
                            : _mm512_sllv_epi16(h, halves_idx(0x00040004, 0x00020002));
  // (l or l >> 4) & 0x0f | hi2 & 0x30: vpternlog's bit select by 0x0f, then clear bits 6-7
  const __m512i lo = chunk ? _mm512_srli_epi16(l, 4) : l;
  return _mm512_and_si512(_mm512_ternarylogic_epi32(lo, hi2, _mm512_set1_epi8(0x0f), 0xe4),
                          _mm512_set1_epi8(0x3f));
}

// Q6_K, T <= 4 tokens against R <= 4 rows: per super-block, row and token 4 vpdpbusd (64 codes each,
// from the offset's accumulator start QAct::corr) and 2 vpdpwssd by the sub-blocks' scales
// into 16 lanes whose sum is S = sum_s sc_s * dot_s. The rows' lanes are added (exact),
// then per super-block acc = fma(float(S), d * d_x, acc) in one lane a row: cpu_kpanel.h's
// prompt sequence.
template <int R, int T>
inline void tile_q6k(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     float* out, int64_t os) {
  static_assert(R <= 4 && T <= 4, "AVX-512: at most 4 rows x 4 tokens (cpu_kpanel.h for more)");
  const int64_t nsb = a.len / 256;
  const KIdx& ix = kidx();
  __m128 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    prefetch_next_rows<R, T, 210>(w + sb * 210, row_bytes);
    __m512i isum[4][T];
    uint16_t dh[4] = {0, 0, 0, 0};
    for (int r = 0; r < 4; ++r)
      for (int t = 0; t < T; ++t) isum[r][t] = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) std::memcpy(&dh[r], w + r * row_bytes + sb * 210 + 208, 2);
    for (int p = 0; p < 2; ++p) {   // half p: chunks 2p, 2p + 1
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = w + r * row_bytes + sb * 210;
        const __m512i w0 = q6k_codes(blk + 64 * p, blk + 128 + 32 * p, 0);
        const __m512i w1 = q6k_codes(blk + 64 * p, blk + 128 + 32 * p, 1);
        const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
        const __m512i sv = _mm512_permutexvar_epi16(_mm512_load_si512(ix.q6[p]), sc);
        for (int t = 0; t < T; ++t) {
          const int8_t* xq = a.q_of(tok[t]) + sb * 256 + 128 * p;
          const int32_t* xc = a.corr_of(tok[t]) + sb * 64 + 32 * p;
          isum[r][t] = scaled_pair(
              isum[r][t], _mm512_dpbusd_epi32(_mm512_loadu_si512(xc), w0, _mm512_loadu_si512(xq)),
              _mm512_dpbusd_epi32(_mm512_loadu_si512(xc + 16), w1, _mm512_loadu_si512(xq + 64)), sv);
        }
      }
    }
    const __m128 d4 = halves4(dh);
    for (int t = 0; t < T; ++t) {
      const __m512i rows[4] = {isum[0][t], isum[1][t], isum[2][t], isum[3][t]};
      const __m512i v = sum_fours(rows);   // chunk c, lane r: a quarter of row r's S
      const __m512i h = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
      const __m512i u = _mm512_add_epi32(h, _mm512_shuffle_i32x4(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
      acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm512_castsi512_si128(u)),
                            _mm_mul_ps(d4, _mm_set1_ps(a.d_of(tok[t])[sb])), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(16) float o[4];
    _mm_store_ps(o, acc[t]);
    for (int r = 0; r < R; ++r) out[t * os + r] = o[r];
  }
}

#elif defined(MOEJAX_QDOT_AVX2)

template <int R, int T>
inline void tile_q4k(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     float* out, int64_t os) {
  const int64_t nsb = a.len / 256;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    prefetch_next_rows<R, T, 144>(w + sb * 144, row_bytes);
    uint8_t sc[R][8], m[R][8];
    __m256i isum[R][T];
    for (int r = 0; r < R; ++r) {
      q4k_scales(w + r * row_bytes + sb * 144 + 4, sc[r], m[r]);
      for (int t = 0; t < T; ++t) isum[r][t] = _mm256_setzero_si256();
    }
    for (int k = 0; k < 4; ++k) {   // 32 bytes of codes: sub-blocks 2k (low), 2k + 1 (high)
      __m256i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            w + r * row_bytes + sb * 144 + 16 + 32 * k));
        lo[r] = _mm256_and_si256(raw, nib);
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
      }
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.q_of(tok[t]) + sb * 256;
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            xq + 32 * q4k_slot(2 * k)));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            xq + 32 * q4k_slot(2 * k + 1)));
        for (int r = 0; r < R; ++r) {
          const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[r], xl),
                                               _mm256_set1_epi16(sc[r][2 * k]));
          const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[r], xh),
                                               _mm256_set1_epi16(sc[r][2 * k + 1]));
          isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_add_epi32(pl, ph));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + sb * 144;
      const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m[r])));
      const __m256 wd = _mm256_set1_ps(half_at(blk)), wmin = _mm256_set1_ps(half_at(blk + 2));
      for (int t = 0; t < T; ++t) {
        const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
            a.bsum_of(tok[t]) + sb * 8));
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_zextsi128_si256(_mm_madd_epi16(m16, bs)));
        const __m256 v = _mm256_fnmadd_ps(mins, wmin,
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][t]), wd));
        acc[r][t] = _mm256_fmadd_ps(v, _mm256_set1_ps(a.d_of(tok[t])[sb]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * os + r] = hsum8i(acc[r][t]);
}

// 32 codes of a Q6_K half: quarter j = its elements 32j .. 32j + 31.
inline __m256i q6k_codes8(const uint8_t* ql, const uint8_t* qh, int j) {
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (j % 2)));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const __m256i lo4 = _mm256_and_si256(j < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0f));
  const __m256i hi2 = j == 0 ? _mm256_slli_epi16(h, 4) : j == 1 ? _mm256_slli_epi16(h, 2)
                    : j == 2 ? h : _mm256_srli_epi16(h, 2);
  return _mm256_or_si256(lo4, _mm256_and_si256(hi2, _mm256_set1_epi8(0x30)));
}

template <int R, int T>
inline void tile_q6k(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     float* out, int64_t os) {
  const int64_t nsb = a.len / 256;
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    prefetch_next_rows<R, T, 210>(w + sb * 210, row_bytes);
    __m256i isum[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) isum[r][t] = _mm256_setzero_si256();
    for (int q = 0; q < 8; ++q) {   // 32 elements: half q / 4, quarter q % 4; sub-blocks 2q, 2q + 1
      __m256i wq[R], sv[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = w + r * row_bytes + sb * 210;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        wq[r] = q6k_codes8(blk + 64 * (q / 4), blk + 128 + 32 * (q / 4), q % 4);
        sv[r] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * q + 1]), _mm_set1_epi16(sc[2 * q]));
      }
      for (int t = 0; t < T; ++t) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            a.q_of(tok[t]) + sb * 256 + 32 * q));
        const __m256i x32 = _mm256_maddubs_epi16(_mm256_set1_epi8(32), xq);   // the offset
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(wq[r], xq), x32);
          isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_madd_epi16(p, sv[r]));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 wd = _mm256_set1_ps(half_at(w + r * row_bytes + sb * 210 + 208));
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][t]), wd),
                                    _mm256_set1_ps(a.d_of(tok[t])[sb]), acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * os + r] = hsum8i(acc[r][t]);
}

#else

// Scalar: the integer sums per super-block, then acc += (isum * d - mins) * d_x.
template <int R, int T>
inline void tile_q4k(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     float* out, int64_t os) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float acc = 0.0f;
      for (int64_t sb = 0; sb < a.len / 256; ++sb) {
        const uint8_t* blk = w + r * row_bytes + sb * 144;
        const int8_t* xq = a.q_of(tok[t]) + sb * 256;
        const int16_t* bs = a.bsum_of(tok[t]) + sb * 8;
        uint8_t sc[8], m[8];
        q4k_scales(blk + 4, sc, m);
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < 32; ++i)
            dot += ((blk[16 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15) * xq[32 * q4k_slot(j) + i];
          isum += sc[j] * dot;
          msum += m[j] * bs[j];
        }
        const float v = std::fma(-static_cast<float>(msum), half_at(blk + 2),
                                 static_cast<float>(isum) * half_at(blk));
        acc = std::fma(v, a.d_of(tok[t])[sb], acc);
      }
      out[t * os + r] = acc;
    }
}

template <int R, int T>
inline void tile_q6k(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     float* out, int64_t os) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float acc = 0.0f;
      for (int64_t sb = 0; sb < a.len / 256; ++sb) {
        const uint8_t* blk = w + r * row_bytes + sb * 210;
        const int8_t* xq = a.q_of(tok[t]) + sb * 256;
        int32_t isum = 0;
        for (int e = 0; e < 256; e += 16) {
          int32_t dot = 0;
          for (int i = e; i < e + 16; ++i) {   // element i: half i / 128, quarter (i / 32) % 4
            const int h = i / 128, j = (i % 128) / 32, l = i % 32;
            const int lo = (blk[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 15;
            const int hi = (blk[128 + 32 * h + l] >> (2 * j)) & 3;
            dot += ((lo | hi << 4) - 32) * xq[i];
          }
          isum += static_cast<int8_t>(blk[192 + e / 16]) * dot;
        }
        acc = std::fma(static_cast<float>(isum) * half_at(blk + 208), a.d_of(tok[t])[sb], acc);
      }
      out[t * os + r] = acc;
    }
}

#endif

}  // namespace moejax
