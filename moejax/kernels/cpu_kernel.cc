// Routed-expert SwiGLU FFN for XLA's CPU backend, called through jax.ffi.
//
//   y[n] = sum_k gates[n, k] * down[e] @ (silu(gate[e] @ x[n]) * up[e] @ x[n]),  e = ids[n, k]
//
// with gate_up[e] = [gate; up] of shape [2I, D] and down[e] of shape [D, I], read in
// place (the table or the offload engine's slot buffers; no copy of a selected expert).
// Pairs whose gate is 0 are skipped (they add nothing).
// The (token, expert) pairs are sorted by expert and cut into blocks of up to kBlock
// tokens. In a prompt each block is one work item (both matmuls of one expert for its
// tokens), ~N*K/kBlock items shared between the calling thread and XLA's intra-op thread
// pool. A decode call (up to kDecodeTokens tokens) runs in finer items, 32 gate/up rows or
// 64 down rows of one block, shared with helper threads that stay awake between calls
// (Spinners). Weights and activations are f32 or bf16; products are accumulated in f32
// (bf16 tokens meet bf16 gate/up rows as bf16 pairs where the CPU has AVX512-BF16:
// cpu_dot.h's Step; the down rows take SwiGLU's f32 activations).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_dot.h"
#include "cpu_layer.h"
#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;  // tokens of one expert per work item
constexpr int64_t kDecodeTokens = 16;  // calls of up to this many tokens: decode_phases

using moejax::to_bf16;
using moejax::to_f32;
using moejax::parallel_for;
using moejax::rows_dot;

void to_f32_rows(const void* x, bool bf16, int64_t count, float* out) {
  if (!bf16) {
    std::memcpy(out, x, count * sizeof(float));
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(x);
  for (int64_t j = 0; j < count; ++j) out[j] = to_f32(src[j]);
}

// SwiGLU's activation, silu(g) * u: the one expression both expert paths use, so that
// per-block items and decode_phases give the same bits.
inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

struct Item {
  int64_t expert, begin, end;  // a run of pairs in the expert-sorted order
};

struct Problem {
  int64_t n, k, d, inter, num_experts;
  const void* x;
  bool x_bf16;
  const int32_t* ids;
  const float* gates;
  const void* gate_up;
  const void* down;
  bool w_bf16;
  bool pairs;  // bf16 tokens meet bf16 gate/up rows as bf16 pairs (cpu_dot.h, kPairs)
  std::vector<int64_t> order;  // pair indices (n * k + j) sorted by expert
  std::vector<Item> items;
  std::vector<float> pair_out;  // [n * k, d], gate applied
};

// xs[t] = x[token of the t-th sorted pair from `first`], in f32, for `count` pairs.
void gather_x(const Problem& p, int64_t first, int64_t count, float* xs) {
  const int64_t d = p.d, width = p.x_bf16 ? 2 : 4;
  for (int64_t t = 0; t < count; ++t)
    to_f32_rows(static_cast<const char*>(p.x) + (p.order[first + t] / p.k) * d * width,
                p.x_bf16, d, xs + t * d);
}

// xs16[t] = x[token of the t-th sorted pair from `first`], bf16 bits (p.pairs only).
void gather_x16(const Problem& p, int64_t first, int64_t count, uint16_t* xs16) {
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  for (int64_t t = 0; t < count; ++t)
    std::memcpy(xs16 + t * p.d, x + (p.order[first + t] / p.k) * p.d, p.d * sizeof(uint16_t));
}

// out[t, r] = gate_up[r, :] . x[t, :] for `rows` gate/up rows: bf16 pairs with xs16 (bf16
// rows and tokens, p.pairs), else the widened dot with xs.
template <typename W>
void gate_up_dot(const Problem& p, const W* gu, int64_t rows, const float* xs,
                 const uint16_t* xs16, int64_t nt, float* out, int64_t os) {
  if constexpr (sizeof(W) == 2 && moejax::kPairs)
    if (p.pairs) return rows_dot(gu, rows, p.d, xs16, nt, out, os);
  rows_dot(gu, rows, p.d, xs, nt, out, os);
}

template <typename W>
void run_item(const Problem& p, const Item& it) {
  const int64_t nt = it.end - it.begin, d = p.d, inter = p.inter;
  thread_local std::vector<float> xs, h, a, y;
  thread_local std::vector<uint16_t> xs16;
  h.resize(nt * 2 * inter);
  a.resize(nt * inter);
  y.resize(nt * d);
  if (p.pairs) {
    xs16.resize(nt * d);
    gather_x16(p, it.begin, nt, xs16.data());
  } else {
    xs.resize(nt * d);
    gather_x(p, it.begin, nt, xs.data());
  }
  const W* gu = static_cast<const W*>(p.gate_up) + it.expert * 2 * inter * d;
  const W* dn = static_cast<const W*>(p.down) + it.expert * d * inter;
  gate_up_dot(p, gu, 2 * inter, xs.data(), xs16.data(), nt, h.data(), 2 * inter);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t j = 0; j < inter; ++j)
      a[t * inter + j] = silu_mul(h[t * 2 * inter + j], h[t * 2 * inter + inter + j]);
  rows_dot(dn, d, inter, a.data(), nt, y.data(), d);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t pair = p.order[it.begin + t];
    const float g = p.gates[pair];
    float* dst = const_cast<float*>(p.pair_out.data()) + pair * d;
    for (int64_t j = 0; j < d; ++j) dst[j] = g * y[t * d + j];
  }
}

// A decode call (a few tokens) in finer items, so that both threads stay busy to the end:
// phase 1 = (block, 32 gate rows + the matching 32 up rows, then their activations),
// phase 2 = (block, 64 rows of down). Every row's dot is computed as run_item computes it,
// so the results are the same bits.
constexpr int64_t kActChunk = 32, kDownChunk = 64;

template <typename W>
void decode_phases(ffi::ThreadPool& pool, Problem& p) {
  const int64_t d = p.d, inter = p.inter, rows = static_cast<int64_t>(p.order.size());
  std::vector<float> xs(p.pairs ? 0 : rows * d), a(rows * inter);
  std::vector<uint16_t> xs16(p.pairs ? rows * d : 0);
  if (p.pairs) gather_x16(p, 0, rows, xs16.data());
  else gather_x(p, 0, rows, xs.data());
  const W* gate_up = static_cast<const W*>(p.gate_up);
  const W* down = static_cast<const W*>(p.down);
  const int64_t items = static_cast<int64_t>(p.items.size());
  const int64_t c1 = (inter + kActChunk - 1) / kActChunk, c2 = (d + kDownChunk - 1) / kDownChunk;
  parallel_for(pool, items * c1, [&](int64_t q) {
    const Item& it = p.items[q / c1];
    const int64_t nt = it.end - it.begin, j0 = (q % c1) * kActChunk;
    const int64_t nj = std::min(kActChunk, inter - j0);
    const W* gu = gate_up + it.expert * 2 * inter * d;
    float g[kActChunk * kBlock], u[kActChunk * kBlock];
    const float* xt = p.pairs ? nullptr : xs.data() + it.begin * d;
    const uint16_t* xt16 = p.pairs ? xs16.data() + it.begin * d : nullptr;
    gate_up_dot(p, gu + j0 * d, nj, xt, xt16, nt, g, nj);
    gate_up_dot(p, gu + (inter + j0) * d, nj, xt, xt16, nt, u, nj);
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t j = 0; j < nj; ++j)
        a[(it.begin + t) * inter + j0 + j] = silu_mul(g[t * nj + j], u[t * nj + j]);
  }, true);
  parallel_for(pool, items * c2, [&](int64_t q) {
    const Item& it = p.items[q / c2];
    const int64_t nt = it.end - it.begin, r0 = (q % c2) * kDownChunk;
    const int64_t nr = std::min(kDownChunk, d - r0);
    float y[kDownChunk * kBlock];
    rows_dot(down + it.expert * d * inter + r0 * inter, nr, inter, &a[it.begin * inter], nt,
             y, nr);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t pair = p.order[it.begin + t];
      const float gate = p.gates[pair];
      for (int64_t j = 0; j < nr; ++j) p.pair_out[pair * d + r0 + j] = gate * y[t * nr + j];
    }
  }, true);
}


void store(const float* src, int64_t count, bool bf16, void* dst) {
  if (!bf16) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < count; ++j) out[j] = to_bf16(src[j]);
}

bool is_bf16(ffi::DataType t) { return t == ffi::DataType::BF16; }
bool supported(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }
// weights may also be bf16 held as their uint16 bits (the engine's program store,
// read in place by the prompt pass)
bool weights_bf16(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::U16; }
bool weights_ok(ffi::DataType t) { return supported(t) || t == ffi::DataType::U16; }

ffi::Error ExpertFfnCore(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> gates, const moejax::Slab& gate_up,
                         const moejax::Slab& down, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), idd = ids.dimensions();
  const auto& gud = gate_up.dims;
  const auto& dnd = down.dims;
  if (xd.size() != 2 || idd.size() != 2 || gud.size() != 3 || dnd.size() != 3)
    return ffi::Error::InvalidArgument("moejax_expert_ffn: expected x [N,D], ids [N,K], "
                                       "gate_up [E,2I,D], down [E,D,I]");
  if (!supported(x.element_type()) || !weights_ok(gate_up.type) ||
      gate_up.type != down.type || y->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("moejax_expert_ffn: f32 or bf16 only (weights also "
                                       "as uint16 bf16 bits)");
  auto p = std::make_unique<Problem>();
  p->n = xd[0];
  p->d = xd[1];
  p->k = idd[1];
  p->num_experts = gud[0];
  p->inter = gud[1] / 2;
  if (gud[2] != p->d || dnd[1] != p->d || dnd[2] != p->inter || dnd[0] != p->num_experts)
    return ffi::Error::InvalidArgument("moejax_expert_ffn: expert shapes do not match x");
  p->x = x.untyped_data();
  p->x_bf16 = is_bf16(x.element_type());
  p->ids = ids.typed_data();
  p->gates = gates.typed_data();
  p->gate_up = gate_up.data;
  p->down = down.data;
  p->w_bf16 = weights_bf16(gate_up.type);
  p->pairs = moejax::kPairs && p->x_bf16 && p->w_bf16;

  // counting sort of the pairs by expert (ids clamped like XLA's dynamic indexing); a pair
  // whose gate is 0 is not computed (its output stays 0: an offload step's pairs served
  // elsewhere, a batch's inactive rows)
  const int64_t pairs = p->n * p->k, ne = p->num_experts;
  std::vector<int64_t> count(ne + 1, 0);
  std::vector<int64_t> expert_of(pairs, -1);
  int64_t live = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    if (p->gates[i] == 0.0f) continue;
    expert_of[i] = std::min<int64_t>(std::max<int64_t>(p->ids[i], 0), ne - 1);
    ++count[expert_of[i] + 1];
    ++live;
  }
  for (int64_t e = 0; e < ne; ++e) count[e + 1] += count[e];
  p->order.resize(live);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < pairs; ++i)
    if (expert_of[i] >= 0) p->order[fill[expert_of[i]]++] = i;
  for (int64_t e = 0; e < ne; ++e) {   // an expert's pairs in equal blocks of <= kBlock
    const int64_t c = count[e + 1] - count[e], nb = (c + kBlock - 1) / kBlock;
    for (int64_t i = 0; i < nb; ++i)
      p->items.push_back({e, count[e] + c * i / nb, count[e] + c * (i + 1) / nb});
  }
  p->pair_out.assign(pairs * p->d, 0.0f);

  const Problem& prob = *p;
  if (p->n <= kDecodeTokens) {
    if (p->w_bf16) decode_phases<uint16_t>(pool, *p);
    else decode_phases<float>(pool, *p);
  } else {
    parallel_for(pool, static_cast<int64_t>(p->items.size()), [&prob](int64_t i) {
      if (prob.w_bf16) run_item<uint16_t>(prob, prob.items[i]);
      else run_item<float>(prob, prob.items[i]);
    }, false);
  }

  const int64_t n = p->n, k = p->k, d = p->d;
  std::vector<float> acc(d);
  for (int64_t t = 0; t < n; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t q = 0; q < k; ++q) {
      const float* src = p->pair_out.data() + (t * k + q) * d;
      for (int64_t j = 0; j < d; ++j) acc[j] += src[j];
    }
    store(acc.data(), d, p->x_bf16, static_cast<char*>(y->untyped_data()) +
                                        t * d * (p->x_bf16 ? 2 : 4));
  }
  return ffi::Error::Success();
}

// The experts of `gate_up`/`down` as given, or of their layer `layer` ([L, E, ...]).
ffi::Error ExpertFfnImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> gates, ffi::AnyBuffer gate_up,
                         ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> y) {
  return ExpertFfnCore(pool, x, ids, gates, moejax::slab(gate_up, -1), moejax::slab(down, -1), y);
}

ffi::Error ExpertFfnAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> gates,
                           ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                           ffi::Result<ffi::AnyBuffer> y) {
  const int64_t l = moejax::layer_of(layer);
  if (gate_up.dimensions().size() != 4 || down.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("moejax_expert_ffn_at: expected gate_up [L,E,2I,D], "
                                       "down [L,E,D,I]");
  return ExpertFfnCore(pool, x, ids, gates, moejax::slab(gate_up, l), moejax::slab(down, l), y);
}

constexpr int64_t kLinearRows = 64;  // output rows per work item
constexpr int64_t kLinearSerialBytes = 256 << 10;  // fewer weight bytes: the calling thread

// y_i = x @ w_i.T for each weight w_i [O_i, D] (one or more: a layer's q/k/v projections of
// the same input run as one call, so one dispatch and one wake-up of the pool cover them).
// layer >= 0: every weight is stacked [L, O, D] and its layer `layer` is read.
ffi::Error LinearCore(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                      ffi::RemainingRets ys, int64_t layer) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != ys.size() ||
      !supported(x.element_type()))
    return ffi::Error::InvalidArgument(
        "moejax_linear: expected x [N,D] (f32 or bf16) and one result per weight");
  const int64_t n = xd[0], d = xd[1];
  const bool x_bf16 = is_bf16(x.element_type());
  struct Out {
    const void* w;
    bool w_bf16;
    int64_t o;
    void* y;
    std::vector<float> acc;
  };
  std::vector<Out> outs;
  std::vector<std::pair<int64_t, int64_t>> items;  // (output, first row)
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("moejax_linear: weights and results are buffers");
    if (layer >= 0 && w->dimensions().size() != 3)
      return ffi::Error::InvalidArgument("moejax_linear_at: expected w [L,O,D]");
    const moejax::Slab ws_l = moejax::slab(*w, layer);
    const auto& wd = ws_l.dims;
    if (wd.size() != 2 || wd[1] != d || !supported(w->element_type()) ||
        (*y)->element_type() != x.element_type() ||
        static_cast<int64_t>((*y)->element_count()) != n * wd[0])
      return ffi::Error::InvalidArgument("moejax_linear: expected w [O,D] and y [N,O]");
    outs.push_back({ws_l.data, is_bf16(w->element_type()), wd[0],
                    (*y)->untyped_data(), std::vector<float>(n * wd[0])});
    for (int64_t r0 = 0; r0 < wd[0]; r0 += kLinearRows)
      items.emplace_back(static_cast<int64_t>(i), r0);
  }
  // bf16 x meets bf16 weights as bf16 pairs where the CPU has them (cpu_dot.h, kPairs);
  // x is widened to f32 only for weights that do not take them
  const bool pairs = moejax::kPairs && x_bf16;
  const uint16_t* x16 = static_cast<const uint16_t*>(x.untyped_data());
  bool widened = false;
  for (const Out& out : outs) widened = widened || !(pairs && out.w_bf16);
  std::vector<float> xs(widened ? n * d : 0);
  if (widened) to_f32_rows(x.untyped_data(), x_bf16, n * d, xs.data());
  int64_t bytes = 0;
  for (const Out& out : outs) bytes += out.o * d * (out.w_bf16 ? 2 : 4);
  auto run = [&](int64_t it) {
    Out& out = outs[items[it].first];
    const int64_t r0 = items[it].second, rows = std::min(kLinearRows, out.o - r0);
    if (out.w_bf16 && pairs) rows_dot(static_cast<const uint16_t*>(out.w) + r0 * d, rows, d,
                                      x16, n, out.acc.data() + r0, out.o);
    else if (out.w_bf16) rows_dot(static_cast<const uint16_t*>(out.w) + r0 * d, rows, d,
                                  xs.data(), n, out.acc.data() + r0, out.o);
    else rows_dot(static_cast<const float*>(out.w) + r0 * d, rows, d, xs.data(), n,
                  out.acc.data() + r0, out.o);
  };
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (bytes < kLinearSerialBytes) {   // a small model's projections: no helper to wake
    for (int64_t it = 0; it < num_items; ++it) run(it);
  } else {
    parallel_for(pool, num_items, run, true);
  }
  for (Out& out : outs) store(out.acc.data(), n * out.o, x_bf16, out.y);
  return ffi::Error::Success();
}

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                      ffi::RemainingRets ys) {
  return LinearCore(pool, x, ws, ys, -1);
}

ffi::Error LinearAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer x,
                        ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  return LinearCore(pool, x, ws, ys, moejax::layer_of(layer));
}

}  // namespace
// Sets how long the decode helpers spin after a job, in us (0: XLA's pool tasks instead).
extern "C" void moejax_set_spin_us(int64_t us) {
  moejax::g_spin_us = std::max<int64_t>(0, us);
}

// Whether a decode loop runs (cpu_kernel.decoding): the helpers spin after a job only then.
extern "C" void moejax_set_decoding(int on) { moejax::g_decoding = on != 0; }
extern "C" int moejax_decoding() { return moejax::g_decoding.load() ? 1 : 0; }

// The dots' width in f32 lanes (16 with AVX-512, else 8) and whether bf16 tokens meet
// bf16 rows as bf16 pairs (AVX512-BF16): cpu_dot.h's kLanes and kPairs.
extern "C" int moejax_lanes() { return moejax::kLanes; }
extern "C" int moejax_pairs() { return moejax::kPairs ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxExpertFfn, ExpertFfnImpl, moejax::experts_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxLinearAt, LinearAtImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxExpertFfnAt, ExpertFfnAtImpl, moejax::experts_at_binding());
