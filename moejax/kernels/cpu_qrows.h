// Rows of GGUF quantized weights against quantized tokens: out[t, r] = w[r] . x[tok[t]]
// for every type (cpu_qdot.h: Q8_0, Q4_0; cpu_kdot.h: Q4_K, Q6_K), in tiles of rows x
// tokens. A tile only shares the loads and the unpacking of a row's blocks between its
// tokens (and of a token's codes between its rows); every (row, token) runs the same
// instructions in any tile, so a token's result has the same bits alone (decode) or in a
// prompt, whatever the tile it lands in.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_kdot.h"
#include "cpu_kpanel.h"
#include "cpu_qact.h"
#include "cpu_qdot.h"
#include "cpu_qpanel.h"

namespace moejax {

template <int Q, int R, int T>
inline void qtile(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                  float* out, int64_t os) {
  if constexpr (Q == kQ8_0 || Q == kQ4_0) tile32<Q, R, T>(w, row_bytes, a, tok, out, os);
  else if constexpr (Q == kQ4_K) tile_q4k<R, T>(w, row_bytes, a, tok, out, os);
  else tile_q6k<R, T>(w, row_bytes, a, tok, out, os);
}

// A prompt's tiles (AVX2): kQRows rows x up to kQTokens tokens, each row's unpacked blocks
// used by 4 tokens and each token's codes by 4 rows (64 tokens x 256 rows of 2048 from L2
// on one core, GFLOP/s 4 x 2 -> 4 x 4 tiles: Q8_0 65 -> 71, Q4_0 65 -> 75, Q4_K 66 -> 88,
// Q6_K 51 -> 68). AVX-512's prompts go by panels of 16 rows instead (cpu_qpanel.h,
// cpu_kpanel.h). A decode
// token reads kQDecodeRows rows at once, the token's loads shared by 4 rows (2048 x 768
// Q4_0 on one core 44 -> 33 us against one row at a time; Q6_K 1024 x 2048 from L2 0.067
// -> 0.062 ms against 2 rows).
constexpr int64_t kQRows = 4, kQTokens = 4, kQDecodeRows = 4;

// One tile of R rows and nt <= T tokens.
template <int Q, int R, int T = kQTokens>
inline void qtile_nt(const uint8_t* w, int64_t row_bytes, const QAct& a, const int64_t* tok,
                     int64_t nt, float* out, int64_t os) {
  if constexpr (T == 1) qtile<Q, R, 1>(w, row_bytes, a, tok, out, os);
  else if (nt == T) qtile<Q, R, T>(w, row_bytes, a, tok, out, os);
  else qtile_nt<Q, R, T - 1>(w, row_bytes, a, tok, nt, out, os);
}

#if defined(MOEJAX_QDOT_VNNI512)
// AVX-512: a call of enough tokens by panels (cpu_qpanel.h, cpu_kpanel.h); fewer in tiles
// of 4 rows x up to 4 tokens (K-quants: a panel's repack costs about 8 tokens' dots) or
// one token (Q8_0 / Q4_0 take panels from 2 tokens: 16384 rows of 2048, one core, 2
// tokens 1.36 ms against 1.35 for the 4 x 2 tiles of before, 3 tokens 1.54 against 1.61).
template <int Q>
inline void qrows_dot32(const uint8_t* w, int64_t rows, int64_t row_bytes, const QAct& a,
                        const int64_t* tok, int64_t nt, float* out, int64_t os) {
  constexpr bool kquant = Q == kQ4_K || Q == kQ6_K;
  if (nt >= (Q == kQ4_K ? kQ4KPanelMinTokens : Q == kQ6_K ? kQ6KPanelMinTokens : kPanelMinTokens)) {
    using Kind = std::conditional_t<Q == kQ4_K, PanelQ4K,
                                    std::conditional_t<Q == kQ6_K, PanelQ6K, Panel32<Q>>>;
    return panel_rows_dot<Kind>(w, rows, row_bytes, a, tok, nt, out, os);
  }
  constexpr int64_t kT = kquant ? kQTokens : 1;
  for (int64_t t = 0; t < nt; t += kT) {
    const int64_t n = std::min(kT, nt - t);
    const int64_t* tk = tok + t;
    float* o = out + t * os;
    int64_t r = 0;
    for (; r + kQDecodeRows <= rows; r += kQDecodeRows)
      qtile_nt<Q, kQDecodeRows, kT>(w + r * row_bytes, row_bytes, a, tk, n, o + r, os);
    const uint8_t* wr = w + r * row_bytes;
    if (rows - r == 3) qtile_nt<Q, 3, kT>(wr, row_bytes, a, tk, n, o + r, os);
    else if (rows - r == 2) qtile_nt<Q, 2, kT>(wr, row_bytes, a, tk, n, o + r, os);
    else if (rows - r == 1) qtile_nt<Q, 1, kT>(wr, row_bytes, a, tk, n, o + r, os);
  }
}
constexpr bool kPanels = true;
#else
constexpr bool kPanels = false;
#endif

template <int Q>
inline void qrows_dot_t(const uint8_t* w, int64_t rows, int64_t row_bytes, const QAct& a,
                        const int64_t* tok, int64_t nt, float* out, int64_t os) {
  if constexpr (kPanels) {
#if defined(MOEJAX_QDOT_VNNI512)
    qrows_dot32<Q>(w, rows, row_bytes, a, tok, nt, out, os);
#endif
  } else {
    int64_t r = 0;
    if (nt == 1) {
      for (; r + kQDecodeRows <= rows; r += kQDecodeRows)
        qtile<Q, kQDecodeRows, 1>(w + r * row_bytes, row_bytes, a, tok, out + r, os);
      for (; r < rows; ++r) qtile<Q, 1, 1>(w + r * row_bytes, row_bytes, a, tok, out + r, os);
      return;
    }
    for (; r + kQRows <= rows; r += kQRows)
      for (int64_t t = 0; t < nt; t += kQTokens)
        qtile_nt<Q, kQRows>(w + r * row_bytes, row_bytes, a, tok + t,
                            std::min(kQTokens, nt - t), out + t * os + r, os);
    for (; r < rows; ++r)
      for (int64_t t = 0; t < nt; t += kQTokens)
        qtile_nt<Q, 1>(w + r * row_bytes, row_bytes, a, tok + t, std::min(kQTokens, nt - t),
                       out + t * os + r, os);
  }
}

// out[t * os + r] = w[r] . x[tok[t]] for `rows` rows of type `q` (row_bytes each; the
// tokens quantized for that type in `a`) and nt tokens.
inline void qrows_dot(int q, const uint8_t* w, int64_t rows, int64_t row_bytes,
                      const QAct& a, const int64_t* tok, int64_t nt, float* out, int64_t os) {
  switch (q) {
    case kQ8_0: return qrows_dot_t<kQ8_0>(w, rows, row_bytes, a, tok, nt, out, os);
    case kQ4_0: return qrows_dot_t<kQ4_0>(w, rows, row_bytes, a, tok, nt, out, os);
    case kQ4_K: return qrows_dot_t<kQ4_K>(w, rows, row_bytes, a, tok, nt, out, os);
    default: return qrows_dot_t<kQ6_K>(w, rows, row_bytes, a, tok, nt, out, os);
  }
}

}  // namespace moejax
