// A prompt's Q8_0 / Q4_0 dots on AVX-512 VNNI, one row per f32 lane (llama.cpp's repacked
// layouts do the same): 16 rows (a panel) are repacked once per call so that a zmm holds 4
// codes of each row, then every token of the call runs against the panel. A lane sums one
// block's 32 products exactly (8 vpdpbusd, the token's 4 codes broadcast), and the block's
// scales are applied once per lane: acc = fma(float(isum), d_w * d_x, acc), block after
// block. cpu_qdot.h's decode tile computes the same per-(row, token) sequence from the
// rows as they lie, so a token has the same bits alone or in a prompt.
//
// Why: the 4 x 4 tiles this replaced kept a block's products in 4 lanes and scaled each
// lane, three float ops per 4 lanes; here they are three per 16. One core, 32 tokens
// against 768 rows of 2048 from L2, GMAC/s: Q4_0 75 -> 130, Q8_0 51 -> 127; the Sampler's
// 512-token prefill of the wide 4-layer GGUFs, 2 threads: Q4_0 350 -> 475 tok/s, Q8_0
// 250 -> 460. The repack costs one pass over the panel's bytes per call.
#pragma once

#if defined(MOEJAX_QDOT_VNNI512)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_qact.h"

namespace moejax {

constexpr int64_t kPanel = 16;         // rows a panel, one a lane
constexpr int64_t kPanelTokens = 8;    // tokens a step (8 accumulators, 8 sums)
constexpr int64_t kPanelMinTokens = 2; // fewer (one): the decode tile

// 64-byte aligned room for n zmm, grown as needed (a std::vector<__m512i> would drop the
// vector type's attributes as a template argument, which GCC warns about).
class ZmmBuf {
 public:
  void resize(size_t n) {
    if (n <= n_) return;
    p_.reset(static_cast<char*>(std::aligned_alloc(64, n * 64)));
    n_ = n;
  }
  __m512i* i() { return reinterpret_cast<__m512i*>(p_.get()); }
  const __m512i* i() const { return reinterpret_cast<const __m512i*>(p_.get()); }
  __m512* f() { return reinterpret_cast<__m512*>(p_.get()); }
  const __m512* f() const { return reinterpret_cast<const __m512*>(p_.get()); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> p_;
  size_t n_ = 0;
};

// A panel's blocks: per block 8 zmm of unsigned codes (zmm k, lane i: row i's elements
// 4k .. 4k + 3; Q4_0's 0..15 as stored, Q8_0's int8 + 128) and the 16 rows' scales (f32).
struct QPanel {
  ZmmBuf codes, scales;
};

// The vpermt2d indices that pick lanes labelled `want` out of two zmm labelled `a`, `b`
// (labels: row * 8 + dword of the block's codes).
struct PanelIdx {
  alignas(64) int32_t q4_l1[2][16], q4_l2[4][16];
  alignas(64) int32_t q8_l1[2][16], q8_l2[4][16], q8_l3[8][16];
  static void pick(const int* a, const int* b, const int* want, int32_t* idx) {
    for (int l = 0; l < 16; ++l)
      for (int s = 0; s < 32; ++s)
        if ((s < 16 ? a[s] : b[s - 16]) == want[l]) { idx[l] = s; break; }
  }
  PanelIdx() {
    int za[16], zb[16], w[16], la[16], lb[16];
    // Q4_0: Z_j holds rows 4j .. 4j + 3, 4 dwords each (lane l: row 4j + l / 4, dword l % 4).
    // Level 1: rows 8p .. 8p + 7, dwords 2h, 2h + 1 (lane l: row 8p + l % 8, dword 2h + l / 8).
    // Level 2: rows 0 .. 15, dword k.
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 16; ++l) {
        za[l] = (l / 4) * 8 + l % 4;
        zb[l] = (4 + l / 4) * 8 + l % 4;
        w[l] = (l % 8) * 8 + 2 * h + l / 8;
      }
      pick(za, zb, w, q4_l1[h]);
    }
    for (int k = 0; k < 4; ++k) {
      const int h = k / 2;
      for (int l = 0; l < 16; ++l) {
        la[l] = (l % 8) * 8 + 2 * h + l / 8;
        lb[l] = (8 + l % 8) * 8 + 2 * h + l / 8;
        w[l] = l * 8 + k;
      }
      pick(la, lb, w, q4_l2[k]);
    }
    // Q8_0: Z_j holds rows 2j, 2j + 1, 8 dwords each (lane l: row 2j + l / 8, dword l % 8).
    // Level 1: rows 4q .. 4q + 3, dwords 4h .. 4h + 3 (lane l: row 4q + l % 4, dword 4h + l / 4).
    // Level 2: rows 8p .. 8p + 7, dwords 4h + 2j, + 1 (lane l: row 8p + l % 8, dword 4h + 2j + l / 8).
    // Level 3: rows 0 .. 15, dword k.
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 16; ++l) {
        za[l] = (l / 8) * 8 + l % 8;
        zb[l] = (2 + l / 8) * 8 + l % 8;
        w[l] = (l % 4) * 8 + 4 * h + l / 4;
      }
      pick(za, zb, w, q8_l1[h]);
    }
    for (int hj = 0; hj < 4; ++hj) {
      const int h = hj / 2, j = hj % 2;
      for (int l = 0; l < 16; ++l) {
        la[l] = (l % 4) * 8 + 4 * h + l / 4;
        lb[l] = (4 + l % 4) * 8 + 4 * h + l / 4;
        w[l] = (l % 8) * 8 + 4 * h + 2 * j + l / 8;
      }
      pick(la, lb, w, q8_l2[hj]);
    }
    for (int k = 0; k < 8; ++k) {
      const int h = k / 4, j = (k / 2) % 2;
      for (int l = 0; l < 16; ++l) {
        la[l] = (l % 8) * 8 + 4 * h + 2 * j + l / 8;
        lb[l] = (8 + l % 8) * 8 + 4 * h + 2 * j + l / 8;
        w[l] = l * 8 + k;
      }
      pick(la, lb, w, q8_l3[k]);
    }
  }
};
inline const PanelIdx& panel_idx() {
  static const PanelIdx idx;
  return idx;
}
inline __m512i perm2(__m512i a, const int32_t* idx, __m512i b) {
  return _mm512_permutex2var_epi32(a, _mm512_load_si512(idx), b);
}

// out[k], lane i = the dword k of the 16 bytes at rp[i] + at (a 16 x 4 dword transpose).
inline void transpose16x4(const uint8_t* const* rp, int64_t at, __m512i (&out)[4]) {
  const PanelIdx& ix = panel_idx();
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    auto row = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + at)); };
    const __m256i lo = _mm256_set_m128i(row(4 * j + 1), row(4 * j));
    const __m256i hi = _mm256_set_m128i(row(4 * j + 3), row(4 * j + 2));
    z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  const __m512i a0 = perm2(z[0], ix.q4_l1[0], z[1]), a1 = perm2(z[0], ix.q4_l1[1], z[1]);
  const __m512i b0 = perm2(z[2], ix.q4_l1[0], z[3]), b1 = perm2(z[2], ix.q4_l1[1], z[3]);
  for (int k = 0; k < 4; ++k) out[k] = perm2(k < 2 ? a0 : a1, ix.q4_l2[k], k < 2 ? b0 : b1);
}

// The 16 row pointers of a panel of nr rows (the rest: a row of zeros).
inline void panel_rows(const uint8_t* w, int64_t row_bytes, int64_t nr, const uint8_t* (&rp)[kPanel]) {
  thread_local std::vector<uint8_t> zero;
  if (static_cast<int64_t>(zero.size()) < row_bytes) zero.assign(row_bytes, 0);
  for (int64_t i = 0; i < kPanel; ++i) rp[i] = i < nr ? w + i * row_bytes : zero.data();
}

// Packs rows 0 .. nr - 1 (nr <= 16; the rest zero) of nb blocks each into `p`.
template <int Q>
inline void panel_pack(const uint8_t* w, int64_t row_bytes, int64_t nr, int64_t nb, QPanel& p) {
  constexpr int64_t kBytes = Q == kQ8_0 ? 34 : 18;
  const uint8_t* rp[kPanel];
  panel_rows(w, row_bytes, nr, rp);
  p.codes.resize(nb * 8);
  p.scales.resize(nb);
  const PanelIdx& ix = panel_idx();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = b * kBytes;
    alignas(32) uint16_t h[kPanel];
    for (int i = 0; i < kPanel; ++i) std::memcpy(&h[i], rp[i] + at, 2);
    p.scales.f()[b] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
    __m512i* c = p.codes.i() + 8 * b;
    if constexpr (Q == kQ4_0) {
      __m512i raw[4];
      transpose16x4(rp, at + 2, raw);
      const __m512i m = _mm512_set1_epi8(0x0f);
      for (int k = 0; k < 4; ++k) {
        c[k] = _mm512_and_si512(raw[k], m);                           // elements 4k ..
        c[4 + k] = _mm512_and_si512(_mm512_srli_epi16(raw[k], 4), m);  // elements 16 + 4k ..
      }
    } else {
      __m512i z[8], l1[8], l2[8];
      for (int j = 0; j < 8; ++j) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[2 * j] + at + 2));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[2 * j + 1] + at + 2));
        z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
      }
      for (int q = 0; q < 4; ++q)
        for (int h2 = 0; h2 < 2; ++h2) l1[2 * q + h2] = perm2(z[2 * q], ix.q8_l1[h2], z[2 * q + 1]);
      for (int pp = 0; pp < 2; ++pp)
        for (int hj = 0; hj < 4; ++hj)
          l2[4 * pp + hj] = perm2(l1[2 * (2 * pp) + hj / 2], ix.q8_l2[hj], l1[2 * (2 * pp + 1) + hj / 2]);
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int k = 0; k < 8; ++k)
        c[k] = _mm512_xor_si512(perm2(l2[k / 2], ix.q8_l3[k], l2[4 + k / 2]), flip);
    }
  }
}

// Where a token's codes 4k .. 4k + 3 of block b lie in its QAct row (cpu_qact.h's order).
template <int Q>
inline int64_t panel_xoff(int64_t b, int k) {
  if constexpr (Q == kQ8_0) return 32 * b + 4 * k;
  return 128 * (b >> 2) + 16 * (b & 3) + (k < 4 ? 4 * k : 64 + 4 * (k - 4));
}

// out[t * os + i] = row i . token tok[t] for T tokens and the panel's rows in `m`.
template <int Q, int T>
inline void panel_dot(const QPanel& p, int64_t nb, const QAct& a, const int64_t* tok,
                      float* out, int64_t os, __mmask16 m) {
  constexpr int32_t kOff = Q == kQ8_0 ? -128 : -8;
  const int8_t* xq[T];
  const int16_t* xs[T];
  const float* xd[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.q_of(tok[t]);
    xs[t] = a.bsum_of(tok[t]);
    xd[t] = a.d_of(tok[t]);
  }
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i* c = p.codes.i() + 8 * b;
    const __m512 dw = p.scales.f()[b];
    for (int t = 0; t < T; ++t) {
      __m512i s = _mm512_set1_epi32(kOff * xs[t][b]);
      for (int k = 0; k < 8; ++k) {
        int32_t x4;
        std::memcpy(&x4, xq[t] + panel_xoff<Q>(b, k), 4);
        s = _mm512_dpbusd_epi32(s, c[k], _mm512_set1_epi32(x4));
      }
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(xd[t][b])),
                               acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os, m, acc[t]);
}

// A panel kind: its Panel, pack(w, row_bytes, nr, n, p) of nr <= 16 rows, dot<T>(p, n, a,
// tok, out, os, m) of T <= kTokens tokens, n = a row's blocks of kBlock elements.
template <int Q>
struct Panel32 {
  using Panel = QPanel;
  static constexpr int64_t kTokens = kPanelTokens, kBlock = 32;
  static void pack(const uint8_t* w, int64_t row_bytes, int64_t nr, int64_t n, Panel& p) {
    panel_pack<Q>(w, row_bytes, nr, n, p);
  }
  template <int T>
  static void dot(const Panel& p, int64_t n, const QAct& a, const int64_t* tok, float* out,
                  int64_t os, __mmask16 m) {
    panel_dot<Q, T>(p, n, a, tok, out, os, m);
  }
};

// nt <= Kind::kTokens tokens against a packed panel.
template <typename Kind, int T = Kind::kTokens>
inline void panel_dot_nt(const typename Kind::Panel& p, int64_t n, const QAct& a,
                         const int64_t* tok, int64_t nt, float* out, int64_t os, __mmask16 m) {
  if constexpr (T == 1) Kind::template dot<1>(p, n, a, tok, out, os, m);
  else if (nt == T) Kind::template dot<T>(p, n, a, tok, out, os, m);
  else panel_dot_nt<Kind, T - 1>(p, n, a, tok, nt, out, os, m);
}

// out[t * os + r] = w[r] . x[tok[t]] for every row and token, panel by panel (every kind:
// Panel32 here, cpu_kpanel.h's K-quants).
template <typename Kind>
inline void panel_rows_dot(const uint8_t* w, int64_t rows, int64_t row_bytes, const QAct& a,
                           const int64_t* tok, int64_t nt, float* out, int64_t os) {
  thread_local typename Kind::Panel p;
  const int64_t n = a.len / Kind::kBlock;
  for (int64_t r = 0; r < rows; r += kPanel) {
    const int64_t nr = std::min(kPanel, rows - r);
    Kind::pack(w + r * row_bytes, row_bytes, nr, n, p);
    const __mmask16 m = static_cast<__mmask16>((1u << nr) - 1);
    for (int64_t t = 0; t < nt; t += Kind::kTokens)
      panel_dot_nt<Kind>(p, n, a, tok + t, std::min(Kind::kTokens, nt - t), out + t * os + r, os, m);
  }
}

}  // namespace moejax

#endif
