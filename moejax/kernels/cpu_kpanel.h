// A prompt's Q4_K dots on AVX-512 VNNI by panels of 16 rows, one row a lane, as
// cpu_qpanel.h does for Q8_0 / Q4_0. Per super-block (256 elements) and (row, token):
//   S = sum_j sc_j * dot_j   (dot_j: sub-block j's 32 products, 8 vpdpbusd; exact int32)
//   M = sum_j m_j * bsum_j   (the mins' part: the token's sums of 32 codes; 4 vpdpwssd)
//   acc = fma(float(S), d * d_x, acc),  accm = fma(float(M), dmin * d_x, accm)
// and the result is acc - accm. cpu_kdot.h's decode tile computes S and M from the rows as
// they lie and runs the same float sequence, so a token has the same bits alone or in a
// prompt. The 4 x 4 tiles this replaced kept partial sums in 16 lanes and scaled each:
// one core, 32 tokens from L2, GMAC/s 78 -> 128 (768 rows of 2048), 66 -> 136 (2048 of
// 768); the Sampler's 512-token prefill of the wide Q4_K_M GGUF 340 -> 445 tok/s.
#pragma once

#if defined(MOEJAX_QDOT_VNNI512)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kdot.h"
#include "cpu_qact.h"
#include "cpu_qpanel.h"

namespace moejax {

constexpr int64_t kKPanelTokens = 4;   // tokens a step: 8 codes + 4 x (S, acc, accm, sum)
// The fewest tokens a K-quant call takes by panels; fewer go by cpu_kdot.h's tiles of 4
// rows x 4 tokens. A panel's repack (the scales unpacked row by row, 8 or 16 transposes a
// super-block) costs about 8 tokens' dots: one core, 16384 rows of 2048, the tiles against
// panels: Q4_K 3.60 / 3.79 ms at 8 tokens, 5.65 / 4.80 at 12; Q6_K 4.51 / 4.20 at 6.
constexpr int64_t kQ4KPanelMinTokens = 10, kQ6KPanelMinTokens = 6;

// A panel's Q4_K super-blocks: per super-block 64 zmm of codes 0..15 (zmm 8j + kk, lane i:
// row i's elements 32j + 4kk .. + 3), 8 zmm of sub-block scales sc_j (int32), 4 zmm of
// mins in word pairs (m_2p, m_2p+1), and the rows' d and dmin (f32).
struct KPanel {
  ZmmBuf codes, sc, mins, d, dmin;
};

inline void kpanel_pack(const uint8_t* w, int64_t row_bytes, int64_t nr, int64_t nsb, KPanel& p) {
  const uint8_t* rp[kPanel];
  panel_rows(w, row_bytes, nr, rp);
  p.codes.resize(nsb * 64);
  p.sc.resize(nsb * 8);
  p.mins.resize(nsb * 4);
  p.d.resize(nsb);
  p.dmin.resize(nsb);
  const __m512i nib = _mm512_set1_epi8(0x0f);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const int64_t at = sb * 144;
    alignas(64) uint16_t dh[kPanel], mh[kPanel];
    alignas(64) int32_t sc[8][kPanel], mn[4][kPanel];
    for (int i = 0; i < kPanel; ++i) {
      std::memcpy(&dh[i], rp[i] + at, 2);
      std::memcpy(&mh[i], rp[i] + at + 2, 2);
      uint8_t s8[8], m8[8];
      q4k_scales(rp[i] + at + 4, s8, m8);
      for (int j = 0; j < 8; ++j) sc[j][i] = s8[j];
      for (int q = 0; q < 4; ++q) mn[q][i] = m8[2 * q] | m8[2 * q + 1] << 16;
    }
    p.d.f()[sb] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
    p.dmin.f()[sb] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mh)));
    for (int j = 0; j < 8; ++j) p.sc.i()[sb * 8 + j] = _mm512_load_si512(sc[j]);
    for (int q = 0; q < 4; ++q) p.mins.i()[sb * 4 + q] = _mm512_load_si512(mn[q]);
    // qs dword m (m = 0..31): chunk c = m / 8 of 32 bytes, low nibbles sub-block 2c, high 2c + 1
    __m512i* c = p.codes.i() + sb * 64;
    for (int g = 0; g < 8; ++g) {
      __m512i raw[4];
      transpose16x4(rp, at + 16 + 16 * g, raw);
      for (int k = 0; k < 4; ++k) {
        const int m = 4 * g + k, ch = m / 8, kk = m % 8;
        c[8 * (2 * ch) + kk] = _mm512_and_si512(raw[k], nib);
        c[8 * (2 * ch + 1) + kk] = _mm512_and_si512(_mm512_srli_epi16(raw[k], 4), nib);
      }
    }
  }
}

// out[t * os + i] = row i . token tok[t] for T tokens and the panel's rows in `m`.
template <int T>
inline void kpanel_dot(const KPanel& p, int64_t nsb, const QAct& a, const int64_t* tok,
                       float* out, int64_t os, __mmask16 m) {
  const int8_t* xq[T];
  const int16_t* xs[T];
  const float* xd[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.q_of(tok[t]);
    xs[t] = a.bsum_of(tok[t]);
    xd[t] = a.d_of(tok[t]);
  }
  __m512 acc[T], accm[T];
  for (int t = 0; t < T; ++t) acc[t] = accm[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512i s[T];
    for (int t = 0; t < T; ++t) s[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i* c = p.codes.i() + sb * 64 + 8 * j;
      const __m512i sc = p.sc.i()[sb * 8 + j];
      for (int t = 0; t < T; ++t) {
        const int8_t* x = xq[t] + sb * 256 + 32 * q4k_slot(j);
        __m512i dot = _mm512_setzero_si512();
        for (int kk = 0; kk < 8; ++kk) {
          int32_t x4;
          std::memcpy(&x4, x + 4 * kk, 4);
          dot = _mm512_dpbusd_epi32(dot, c[kk], _mm512_set1_epi32(x4));
        }
        s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(dot, sc));
      }
    }
    for (int t = 0; t < T; ++t) {
      __m512i mt = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) {
        int32_t b2;
        std::memcpy(&b2, xs[t] + sb * 8 + 2 * q, 4);
        mt = _mm512_dpwssd_epi32(mt, p.mins.i()[sb * 4 + q], _mm512_set1_epi32(b2));
      }
      const __m512 dx = _mm512_set1_ps(xd[t][sb]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(p.d.f()[sb], dx), acc[t]);
      accm[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mt), _mm512_mul_ps(p.dmin.f()[sb], dx), accm[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os, m, _mm512_sub_ps(acc[t], accm[t]));
}

struct PanelQ4K {
  using Panel = KPanel;
  static constexpr int64_t kTokens = kKPanelTokens, kBlock = 256;
  static void pack(const uint8_t* w, int64_t row_bytes, int64_t nr, int64_t n, Panel& p) {
    kpanel_pack(w, row_bytes, nr, n, p);
  }
  template <int T>
  static void dot(const Panel& p, int64_t n, const QAct& a, const int64_t* tok, float* out,
                  int64_t os, __mmask16 m) {
    kpanel_dot<T>(p, n, a, tok, out, os, m);
  }
};

// A panel's Q6_K super-blocks: per super-block 64 zmm of codes 0..63 (zmm 4s + kk, lane i:
// row i's elements 16s + 4kk .. + 3), 16 zmm of the sub-blocks' scales (int32), d (f32).
struct K6Panel {
  ZmmBuf codes, sc, d;
};

inline void k6panel_pack(const uint8_t* w, int64_t row_bytes, int64_t nr, int64_t nsb, K6Panel& p) {
  const uint8_t* rp[kPanel];
  panel_rows(w, row_bytes, nr, rp);
  p.codes.resize(nsb * 64);
  p.sc.resize(nsb * 16);
  p.d.resize(nsb);
  alignas(64) uint8_t nat[kPanel][256];   // each row's 256 codes in order
  const uint8_t* np[kPanel];
  for (int i = 0; i < kPanel; ++i) np[i] = nat[i];
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const int64_t at = sb * 210;
    alignas(64) uint16_t dh[kPanel];
    alignas(64) int32_t sc[16][kPanel];
    for (int i = 0; i < kPanel; ++i) {
      const uint8_t* blk = rp[i] + at;
      for (int h = 0; h < 2; ++h)
        for (int ch = 0; ch < 2; ++ch)
          _mm512_store_si512(nat[i] + 128 * h + 64 * ch, q6k_codes(blk + 64 * h, blk + 128 + 32 * h, ch));
      for (int j = 0; j < 16; ++j) sc[j][i] = static_cast<int8_t>(blk[192 + j]);
      std::memcpy(&dh[i], blk + 208, 2);
    }
    p.d.f()[sb] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
    for (int j = 0; j < 16; ++j) p.sc.i()[sb * 16 + j] = _mm512_load_si512(sc[j]);
    __m512i* c = p.codes.i() + sb * 64;
    for (int g = 0; g < 16; ++g) {
      __m512i raw[4];
      transpose16x4(np, 16 * g, raw);
      for (int k = 0; k < 4; ++k) c[4 * g + k] = raw[k];
    }
  }
}

// Q6_K: per super-block and (row, token) S = sum_s sc_s * dot_s (dot_s: 16 products of
// (q - 32) * x, from the offset's start, exact), then acc = fma(float(S), d * d_x, acc).
template <int T>
inline void k6panel_dot(const K6Panel& p, int64_t nsb, const QAct& a, const int64_t* tok,
                        float* out, int64_t os, __mmask16 m) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512i s[T];
    int32_t off[T][16];
    for (int t = 0; t < T; ++t) {
      s[t] = _mm512_setzero_si512();
      const int32_t* cr = a.corr_of(tok[t]) + sb * 64;
      for (int j = 0; j < 16; ++j) off[t][j] = cr[4 * j] + cr[4 * j + 1] + cr[4 * j + 2] + cr[4 * j + 3];
    }
    for (int j = 0; j < 16; ++j) {
      const __m512i* c = p.codes.i() + sb * 64 + 4 * j;
      const __m512i sc = p.sc.i()[sb * 16 + j];
      for (int t = 0; t < T; ++t) {
        const int8_t* x = a.q_of(tok[t]) + sb * 256 + 16 * j;
        __m512i dot = _mm512_set1_epi32(off[t][j]);
        for (int kk = 0; kk < 4; ++kk) {
          int32_t x4;
          std::memcpy(&x4, x + 4 * kk, 4);
          dot = _mm512_dpbusd_epi32(dot, c[kk], _mm512_set1_epi32(x4));
        }
        s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(dot, sc));
      }
    }
    for (int t = 0; t < T; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]),
                               _mm512_mul_ps(p.d.f()[sb], _mm512_set1_ps(a.d_of(tok[t])[sb])), acc[t]);
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os, m, acc[t]);
}

struct PanelQ6K {
  using Panel = K6Panel;
  static constexpr int64_t kTokens = kKPanelTokens, kBlock = 256;
  static void pack(const uint8_t* w, int64_t row_bytes, int64_t nr, int64_t n, Panel& p) {
    k6panel_pack(w, row_bytes, nr, n, p);
  }
  template <int T>
  static void dot(const Panel& p, int64_t n, const QAct& a, const int64_t* tok, float* out,
                  int64_t os, __mmask16 m) {
    k6panel_dot<T>(p, n, a, tok, out, os, m);
  }
};

}  // namespace moejax

#endif
