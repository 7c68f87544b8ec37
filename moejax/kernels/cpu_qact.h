// Quantized activations for the GGUF block dots (cpu_qdot.h, cpu_kdot.h). As ggml does
// before its integer dots, a token's f32 row is quantized once per call to 8-bit codes:
// blocks of 32 with an f32 scale for Q8_0 and Q4_0 weights (ggml's Q8_0 keeps the scale
// in f16; f32 here loses nothing), blocks of 256 with one scale for the K-quants (ggml's
// Q8_K). A token's codes depend only on its own row, so a token quantizes to the same codes
// alone or in a prompt, and every dot after it is exact integer work per block.
//
// The weights' types and their numbers (the Python side, cpu_quant.py, uses the same):
//   0 Q8_0: 32 elements in 34 bytes  (f16 d, 32 int8; value q * d)
//   1 Q4_0: 32 elements in 18 bytes  (f16 d, 16 bytes; element j in the low nibble of byte
//           j, element j + 16 in the high nibble; value (q - 8) * d)
//   2 Q4_K: 256 elements in 144 bytes (ggml-common.h's block_q4_K)
//   3 Q6_K: 256 elements in 210 bytes (ggml-common.h's block_q6_K)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

// The dots' instruction set (cpu_qdot.h, cpu_kdot.h): AVX-512 with VNNI and VBMI's byte
// permutes (Ice Lake, Zen 4 and later), else AVX2, else scalar. The activations' layout
// follows it (qact_row).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__F16C__)
#define MOEJAX_QDOT_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MOEJAX_QDOT_AVX2 1
#endif

namespace moejax {

enum QType : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ6_K = 3 };

inline bool qtype_ok(int q) { return q >= kQ8_0 && q <= kQ6_K; }
inline int64_t qblock_elems(int q) { return q == kQ8_0 || q == kQ4_0 ? 32 : 256; }
inline int64_t qblock_bytes(int q) {
  static constexpr int64_t kBytes[] = {34, 18, 144, 210};
  return kBytes[q];
}

// f16 bits -> f32 (the weights' block scales), exact, without F16C.
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);                 // inf, NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);         // normal
  } else if (man == 0) {
    u = sign;                                             // zero
  } else {                                                // subnormal: normalize
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
    u = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// The f16 at p as f32: F16C's vcvtph2ps where the build has it (the same exact value).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_f32(h);
#endif
}

// Where sub-block j (32 codes) of a Q8_K block lies for Q4_K weights, in 32-code slots: a
// 64-byte load of a Q4_K block's codes holds sub-blocks (0, 2) in its low nibbles and
// (1, 3) in its high ones, so the activation keeps them in that order (cpu_kdot.h).
inline int q4k_slot(int j) {
  static constexpr int kSlot[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  return kSlot[j];
}

// The quantized rows of a call's tokens, for one weight type's dots.
//   q:    [rows, stride] codes in [-127, 127], in the order the type's dots load them
//         (below); rows of blocks of 32 padded with zeros to whole groups of 4 blocks
//   d:    [rows, stride / bs] the blocks' scales (a token's value is q * d)
//   dv:   [rows, stride / 4] (AVX-512) the scales spread over the dots' lanes: Q8_0 per
//         64 codes [d0 x 8, d1 x 8]; Q4_0 per 128 codes [d0 x 4, d1 x 4, d2 x 4, d3 x 4]
//   corr: [rows, stride / 4] the dots' accumulator starts for weights stored with an
//         offset o (Q8_0 read unsigned: 128; Q4_0: 8; Q6_K: 32): -o * the sum of the
//         codes each int32 lane multiplies, so a lane ends at sum((w - o) * x)
//   bsum: [rows, len / 32] the sum of each 32 codes in the row's order (Q4_K's mins)
// Code order: Q4_K's sub-blocks as q4k_slot places them; Q4_0 (AVX-512) per group of 4
// blocks the low halves (elements 0-15) of blocks 0-3, then their high halves, as a
// byte permute of the 4 blocks' nibbles gives them; otherwise the row's order.
struct QAct {
  int type = kQ8_0;
  int64_t len = 0, stride = 0, bs = 32;
  std::vector<int8_t> q;
  std::vector<float> d, dv;
  std::vector<int32_t> corr;
  std::vector<int16_t> bsum;
  const int8_t* q_of(int64_t t) const { return q.data() + t * stride; }
  const float* d_of(int64_t t) const { return d.data() + t * (stride / bs); }
  const float* dv_of(int64_t t) const { return dv.data() + t * (stride / 4); }
  const int32_t* corr_of(int64_t t) const { return corr.data() + t * (stride / 4); }
  const int16_t* bsum_of(int64_t t) const { return bsum.data() + t * (len / 32); }
};

// Sizes `a` for `rows` rows of `len` elements, for weights of type `type`.
inline void qact_reset(QAct& a, int type, int64_t rows, int64_t len) {
  a.type = type;
  a.len = len;
  a.bs = qblock_elems(type);
  a.stride = a.bs == 32 ? (len + 127) / 128 * 128 : len;
  a.q.assign(rows * a.stride, 0);
  a.d.assign(rows * (a.stride / a.bs), 0.0f);
  a.dv.assign(rows * (a.stride / 4), 0.0f);
  a.corr.assign(rows * (a.stride / 4), 0);
  a.bsum.assign(rows * (len / 32), 0);
}

// Row t's codes (in the row's order, padded) placed in the type's order, with its spread
// scales and accumulator starts.
inline void qact_layout(const int8_t* nat, QAct& a, int64_t t) {
  int8_t* q = a.q.data() + t * a.stride;
  const float* d = a.d_of(t);
  float* dv = a.dv.data() + t * (a.stride / 4);
  int32_t* corr = a.corr.data() + t * (a.stride / 4);
  auto sum4 = [](const int8_t* c) { return c[0] + c[1] + c[2] + c[3]; };
#if defined(MOEJAX_QDOT_VNNI512)
  const bool groups = a.type == kQ4_0;
#else
  const bool groups = false;
#endif
  if (a.type == kQ4_K) {
    for (int64_t b = 0; b < a.len / 256; ++b)
      for (int j = 0; j < 8; ++j) std::memcpy(q + 256 * b + 32 * q4k_slot(j), nat + 256 * b + 32 * j, 32);
  } else if (groups) {   // Q4_0, AVX-512: groups of 4 blocks, low halves then high halves
    for (int64_t g = 0; g < a.stride / 128; ++g)
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) std::memcpy(q + 128 * g + 64 * h + 16 * i, nat + 128 * g + 32 * i + 16 * h, 16);
    for (int64_t g = 0; g < a.stride / 128; ++g)
      for (int l = 0; l < 16; ++l) {
        corr[16 * g + l] = -8 * (sum4(q + 128 * g + 4 * l) + sum4(q + 128 * g + 64 + 4 * l));
        dv[16 * g + l] = d[4 * g + l / 4];
      }
    return;
  } else {
    std::memcpy(q, nat, a.stride);
  }
  const int offset = a.type == kQ8_0 ? 128 : a.type == kQ4_0 ? 8 : a.type == kQ6_K ? 32 : 0;
  for (int64_t g = 0; g < a.stride / 4; ++g) corr[g] = -offset * sum4(q + 4 * g);
  if (a.type == kQ8_0)
    for (int64_t g = 0; g < a.stride / 4; ++g) dv[g] = d[g / 8];
}

// Quantizes row `t` of `a` from x[len]: each block's largest magnitude maps to 127 and
// every value to the nearest code (ties to even); a block of zeros has scale 0.
inline void qact_row(const float* x, QAct& a, int64_t t) {
  thread_local std::vector<int8_t> nat;
  nat.assign(a.stride, 0);
  float* d = a.d.data() + t * (a.stride / a.bs);
  for (int64_t b = 0; b * a.bs < a.len; ++b) {
    const float* xb = x + b * a.bs;
    int8_t* block = nat.data() + b * a.bs;
    float amax = 0.0f;
    for (int64_t j = 0; j < a.bs; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t j = 0; j < a.bs; ++j) {
      const float v = std::nearbyint(xb[j] * inv);
      block[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
    d[b] = amax / 127.0f;
  }
  int16_t* bsum = a.bsum.data() + t * (a.len / 32);
  for (int64_t j = 0; j < a.len / 32; ++j) {   // sums of 32 in the row's order
    int s = 0;
    for (int i = 0; i < 32; ++i) s += nat[32 * j + i];
    bsum[j] = static_cast<int16_t>(s);
  }
  qact_layout(nat.data(), a, t);
}

}  // namespace moejax
