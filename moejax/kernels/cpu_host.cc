// Rows of tokens, each through its K SwiGLU experts read in place from the host store, for
// the offload engine's HOST misses and a batch's spilled fetches (`sources.host_experts`),
// through jax.ffi:
//
//   y[b] = sum_j gates[b, j] * down[e] @ (silu(gate[e] @ x[b]) * up[e] @ x[b]),  e = ids[b, j]
//
// over the (b, j) with gates[b, j] != 0 only (a zero gate: the expert is not read at all;
// a row with none gets zeros, and a call with none costs no thread wake-up). x [D] with ids
// and gates [K] is one row; x [B, D] with [B, K] is B rows in one call.
// gate_up [E, 2I, D] and down [E, D, I] are f32, bf16, or bf16 held as uint16 bits (the
// program store, `transfer.program_store`); x and y are f32 or bf16, accumulated in f32.
// A one-token expert is a stream of weight rows, each read once: the row dots here keep
// four independent accumulators of the widest vectors the CPU has (AVX-512: 16 lanes;
// else 8): one chain's FMA latency, not memory, bounded a row (docs/policies.md, "Host
// compute"). Two phases on the calling thread
// and the kernel's decode helpers (cpu_threads.h): ((row, expert) pair, 32 rows of gate and
// up, then their activations), then (row, 64 output rows, over its experts in order). Every
// output is summed in a fixed order (per row: lanes, then the four accumulators, then the
// tail; over a row's experts: j = 0..K-1), so the bits depend neither on the threads nor
// on the other rows of the call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_bf16.h"
#include "cpu_layer.h"
#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moejax::to_bf16;
using moejax::to_f32;

constexpr int64_t kActRows = 32, kOutRows = 64;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {   // 16 bf16 -> f32: widen, shift into the high half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
constexpr int kLanes = 8;
struct vf {
  float v[8];
};
inline vf vzero() { return vf{}; }
template <typename W>
inline vf vload(const W* p) {
  vf r;
  for (int i = 0; i < 8; ++i) r.v[i] = to_f32(p[i]);
  return r;
}
inline vf vfma(vf a, vf b, vf c) {
  for (int i = 0; i < 8; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i];
  return c;
}
inline vf vadd(vf a, vf b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline float vsum(vf v) {
  return ((v.v[0] + v.v[4]) + (v.v[1] + v.v[5])) + ((v.v[2] + v.v[6]) + (v.v[3] + v.v[7]));
}
#endif

// dot(w[:n], x[:n]): four accumulators over 4 * kLanes elements a step, then one, then
// the tail in order.
template <typename W>
inline float dot(const W* w, const float* x, int64_t n) {
  vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a0 = vfma(vload(w + i), vload(x + i), a0);
    a1 = vfma(vload(w + i + kLanes), vload(x + i + kLanes), a1);
    a2 = vfma(vload(w + i + 2 * kLanes), vload(x + i + 2 * kLanes), a2);
    a3 = vfma(vload(w + i + 3 * kLanes), vload(x + i + 3 * kLanes), a3);
  }
  for (; i + kLanes <= n; i += kLanes) a0 = vfma(vload(w + i), vload(x + i), a0);
  float s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
  for (; i < n; ++i) s += to_f32(w[i]) * x[i];
  return s;
}

// dot(w[:n], x[:n]) of bf16 weights and a bf16 token (both as bits): with AVX512-BF16 one
// vdpbf16ps per 32 pairs (the products are exact in f32; the pairs are added into two
// accumulators), as llama.cpp's bf16 dot does, without widening the weights first.
// Used where the token is bf16 anyway (a bf16 model's gate/up projections), so no
// precision is lost against widening. Returns false when the CPU lacks the instruction.
constexpr bool kDpBf16 =
#if defined(__AVX512BF16__)
    true;
inline float dot_bf16(const uint16_t* w, const uint16_t* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  auto bh = [](const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); };
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_dpbf16_ps(a0, bh(w + i), bh(x + i));
    a1 = _mm512_dpbf16_ps(a1, bh(w + i + 32), bh(x + i + 32));
  }
  for (; i + 32 <= n; i += 32) a0 = _mm512_dpbf16_ps(a0, bh(w + i), bh(x + i));
  float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < n; ++i) s += to_f32(w[i]) * to_f32(x[i]);
  return s;
}
#else
    false;
inline float dot_bf16(const uint16_t*, const uint16_t*, int64_t) { return 0.0f; }
#endif

// a gate/up row's dot: bf16 pairs where the CPU has them and the token is bf16, else `dot`
template <typename W>
inline float dot_in(const W* w, const float* x, const uint16_t* xb, int64_t n) {
  if constexpr (sizeof(W) == 2 && kDpBf16) {
    if (xb != nullptr) return dot_bf16(w, xb, n);
  }
  return dot(w, x, n);
}

inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

// The work of one call: n (row, expert) pairs, pair p = (row[p], ids[p], gates[p]),
// row b's pairs at start[b] .. start[b + 1] - 1 in the order of its j.
struct Pairs {
  std::vector<int64_t> row, ids, start;
  std::vector<float> gates;
};

template <typename W>
void run(ffi::ThreadPool& pool, const float* x, const uint16_t* xb, const Pairs& pr,
         int64_t rows, int64_t d, int64_t inter, const void* gate_up, const void* down,
         float* y) {
  const W* gu = static_cast<const W*>(gate_up);
  const W* dn = static_cast<const W*>(down);
  const int64_t n = static_cast<int64_t>(pr.ids.size());
  std::vector<float> a(n * inter);
  const int64_t c1 = (inter + kActRows - 1) / kActRows;
  moejax::parallel_for(pool, n * c1, [&](int64_t q) {
    const int64_t p = q / c1, r0 = (q % c1) * kActRows, nr = std::min(kActRows, inter - r0);
    const W* g = gu + pr.ids[p] * 2 * inter * d + r0 * d;
    const W* u = g + inter * d;
    const float* xr = x + pr.row[p] * d;
    const uint16_t* xbr = xb == nullptr ? nullptr : xb + pr.row[p] * d;
    float gs[kActRows];
    for (int64_t r = 0; r < nr; ++r) gs[r] = dot_in(g + r * d, xr, xbr, d);
    for (int64_t r = 0; r < nr; ++r)
      a[p * inter + r0 + r] = silu_mul(gs[r], dot_in(u + r * d, xr, xbr, d));
  }, true);
  const int64_t c2 = (d + kOutRows - 1) / kOutRows;
  moejax::parallel_for(pool, rows * c2, [&](int64_t q) {
    const int64_t b = q / c2, r0 = (q % c2) * kOutRows, nr = std::min(kOutRows, d - r0);
    float acc[kOutRows] = {};
    for (int64_t p = pr.start[b]; p < pr.start[b + 1]; ++p) {
      const W* w = dn + pr.ids[p] * d * inter + r0 * inter;
      for (int64_t r = 0; r < nr; ++r)
        acc[r] += pr.gates[p] * dot(w + r * inter, &a[p * inter], inter);
    }
    std::copy(acc, acc + nr, y + b * d + r0);
  }, true);
}

bool act_ok(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error HostExpertsCore(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                           ffi::Buffer<ffi::F32> gates, const moejax::Slab& gate_up,
                           const moejax::Slab& down, ffi::Result<ffi::AnyBuffer> y) {
  const auto& gud = gate_up.dims;
  const auto& dnd = down.dims;
  const auto wt = gate_up.type, xt = x.element_type();
  const int64_t all_k = static_cast<int64_t>(ids.element_count());
  const auto xd = x.dimensions();
  if (gud.size() != 3 || dnd.size() != 3 || !act_ok(xt) || y->element_type() != xt ||
      !(act_ok(wt) || wt == ffi::DataType::U16) || down.type != wt || xd.size() < 1 ||
      xd.size() > 2 || gates.element_count() != ids.element_count())
    return ffi::Error::InvalidArgument(
        "moejax_host_experts: expected x [D] or [B, D] (f32/bf16), ids and gates [K] or "
        "[B, K], gate_up [E,2I,D] and down [E,D,I] (f32, bf16 or uint16 bf16 bits)");
  const int64_t e = gud[0], inter = gud[1] / 2, d = gud[2];
  const int64_t rows = xd.size() == 2 ? xd[0] : 1;
  if (xd.back() != d || dnd[0] != e || dnd[1] != d || dnd[2] != inter ||
      gud[1] != 2 * inter || rows < 1 || all_k % rows != 0)
    return ffi::Error::InvalidArgument("moejax_host_experts: expert shapes do not match x");
  const int64_t k = all_k / rows;
  // the (row, expert) pairs with a nonzero gate (the engine passes its K slots, the ones not
  // computed on the host with gate 0), ids clamped like XLA's dynamic indexing
  Pairs pr;
  pr.start.push_back(0);
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t j = 0; j < k; ++j) {
      const float g = gates.typed_data()[b * k + j];
      if (g == 0.0f) continue;
      pr.row.push_back(b);
      pr.ids.push_back(std::min<int64_t>(std::max<int64_t>(ids.typed_data()[b * k + j], 0),
                                         e - 1));
      pr.gates.push_back(g);
    }
    pr.start.push_back(static_cast<int64_t>(pr.ids.size()));
  }
  const int64_t m = rows * d;
  const bool x_bf16 = xt == ffi::DataType::BF16;
  std::vector<float> out(m, 0.0f);
  if (!pr.ids.empty()) {
    std::vector<float> xs(m);
    for (int64_t i = 0; i < m; ++i)
      xs[i] = x_bf16 ? to_f32(static_cast<const uint16_t*>(x.untyped_data())[i])
                     : static_cast<const float*>(x.untyped_data())[i];
    const uint16_t* xb = x_bf16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
    if (wt == ffi::DataType::F32)
      run<float>(pool, xs.data(), nullptr, pr, rows, d, inter, gate_up.data, down.data,
                 out.data());
    else
      run<uint16_t>(pool, xs.data(), xb, pr, rows, d, inter, gate_up.data, down.data,
                    out.data());
  }
  for (int64_t i = 0; i < m; ++i) {
    if (x_bf16) static_cast<uint16_t*>(y->untyped_data())[i] = to_bf16(out[i]);
    else static_cast<float*>(y->untyped_data())[i] = out[i];
  }
  return ffi::Error::Success();
}

ffi::Error HostExpertsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                           ffi::Buffer<ffi::F32> gates, ffi::AnyBuffer gate_up,
                           ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> y) {
  return HostExpertsCore(pool, x, ids, gates, moejax::slab(gate_up, -1), moejax::slab(down, -1),
                         y);
}

// The experts of layer `layer` of a stacked store (gate_up [L,E,2I,D], down [L,E,D,I]).
ffi::Error HostExpertsAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> gates,
                             ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                             ffi::Result<ffi::AnyBuffer> y) {
  if (gate_up.dimensions().size() != 4 || down.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("moejax_host_experts_at: expected gate_up [L,E,2I,D], "
                                       "down [L,E,D,I]");
  const int64_t l = moejax::layer_of(layer);
  return HostExpertsCore(pool, x, ids, gates, moejax::slab(gate_up, l), moejax::slab(down, l), y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxHostExpertsAt, HostExpertsAtImpl,
                              moejax::experts_at_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxHostExperts, HostExpertsImpl, moejax::experts_binding());
