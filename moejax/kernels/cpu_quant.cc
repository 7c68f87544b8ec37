// Linear layers and the routed-expert SwiGLU FFN on GGUF quantized weights (Q8_0, Q4_0,
// Q4_K, Q6_K: the raw block bytes, row-major, a uint8 [O, C / bs * bytes] per weight),
// for XLA's CPU backend through jax.ffi (wrapped by cpu_quant.py).
//
// As ggml does, the activations are quantized to 8 bits once per call (cpu_qact.h: blocks
// of 32 for Q8_0/Q4_0 weights, 256 for K-quants) and every row's dot is integer work per
// block with f32 accumulation (cpu_qrows.h). The work is shared as cpu_kernel.cc shares
// the bf16 kernels' work: rows in items of 64 for a linear; for the experts, the (token,
// expert) pairs sorted by expert into blocks of up to 64 tokens, a prompt one item a
// block, a decode call (up to 16 tokens) in finer items (32 gate/up rows, then 64 down
// rows) on the helper threads that stay awake between calls (cpu_threads.h). A row's dot
// does not depend on the item or tile it lands in, so decode and prompt agree bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_layer.h"
#include "cpu_qact.h"
#include "cpu_qrows.h"
#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moejax::QAct;

constexpr int64_t kRows = 64;            // a linear's output rows per work item
constexpr int64_t kSerialBytes = 256 << 10;   // fewer weight bytes: the calling thread alone
constexpr int64_t kBlock = 64;           // tokens of one expert per prompt work item
constexpr int64_t kDecodeTokens = 16;    // calls of up to this many tokens: decode items
constexpr int64_t kActChunk = 32, kDownChunk = 64;

bool is_bf16(ffi::DataType t) { return t == ffi::DataType::BF16; }
bool x_ok(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

// SwiGLU's activation, as cpu_kernel.cc computes it.
inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

// Row `row` of x (f32 or bf16) as f32.
void row_f32(const void* x, bool bf16, int64_t row, int64_t len, float* out) {
  if (!bf16) {
    std::memcpy(out, static_cast<const float*>(x) + row * len, len * sizeof(float));
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(x) + row * len;
  for (int64_t j = 0; j < len; ++j) out[j] = moejax::to_f32(src[j]);
}

void store(const float* src, int64_t count, bool bf16, void* dst) {
  if (!bf16) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < count; ++j) out[j] = moejax::to_bf16(src[j]);
}

// The rows of x quantized for weights of type q into `a` (rows in parallel for a prompt).
void quantize_x(ffi::ThreadPool& pool, const void* x, bool bf16, int64_t n, int64_t len,
                int q, QAct& a) {
  moejax::qact_reset(a, q, n, len);
  auto one = [&](int64_t t) {
    thread_local std::vector<float> xf;
    xf.resize(len);
    row_f32(x, bf16, t, len, xf.data());
    moejax::qact_row(xf.data(), a, t);
  };
  if (n <= kDecodeTokens) {
    for (int64_t t = 0; t < n; ++t) one(t);
  } else {
    moejax::parallel_for(pool, n, one, false);
  }
}


// y_i = x @ dequant(w_i).T for each quantized weight w_i [O_i, B_i] of type qtypes[i]
// (one or more: projections of one input in one call). layer >= 0: stacked [L, O, B].
ffi::Error LinearQCore(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                       ffi::RemainingRets ys, ffi::Span<const int32_t> qtypes, int64_t layer) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != ys.size() ||
      qtypes.size() != ws.size() || !x_ok(x.element_type()))
    return ffi::Error::InvalidArgument("moejax_linear_q: expected x [N,C] (f32 or bf16), "
                                       "one result and one qtype per weight");
  const int64_t n = xd[0], c = xd[1];
  const bool bf16 = is_bf16(x.element_type());
  struct Out {
    const uint8_t* w;
    int q;
    int64_t o, row_bytes;
    void* y;
    std::vector<float> acc;
  };
  std::vector<Out> outs;
  std::vector<std::pair<int64_t, int64_t>> items;   // (output, first row)
  bool need[4] = {false, false, false, false};   // an activation a weight type
  int64_t bytes = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    const int q = qtypes[i];
    if (!w.has_value() || !y.has_value() || !moejax::qtype_ok(q))
      return ffi::Error::InvalidArgument("moejax_linear_q: weights and results are buffers; "
                                         "qtypes 0-3 (q8_0, q4_0, q4_k, q6_k)");
    const moejax::Slab s = moejax::slab(*w, layer);
    const int64_t bs = moejax::qblock_elems(q), rb = c / bs * moejax::qblock_bytes(q);
    if (w->element_type() != ffi::DataType::U8 || s.dims.size() != 2 || c % bs != 0 ||
        s.dims[1] != rb || (*y)->element_type() != x.element_type() ||
        static_cast<int64_t>((*y)->element_count()) != n * s.dims[0])
      return ffi::Error::InvalidArgument(
          "moejax_linear_q: expected w uint8 [O, C/bs*type_size] (or [L, O, ...] with a "
          "layer), C a multiple of the block, and y [N, O] of x's dtype");
    outs.push_back({static_cast<const uint8_t*>(s.data), q, s.dims[0], rb,
                    (*y)->untyped_data(), std::vector<float>(n * s.dims[0])});
    need[q] = true;
    bytes += s.dims[0] * rb;
    for (int64_t r0 = 0; r0 < s.dims[0]; r0 += kRows) items.emplace_back(i, r0);
  }
  QAct acts[4];   // x quantized in each weight type's layout (cpu_qact.h)
  for (int q = 0; q < 4; ++q)
    if (need[q]) quantize_x(pool, x.untyped_data(), bf16, n, c, q, acts[q]);
  std::vector<int64_t> tok(n);
  std::iota(tok.begin(), tok.end(), 0);
  auto run = [&](int64_t it) {
    Out& out = outs[items[it].first];
    const int64_t r0 = items[it].second, rows = std::min(kRows, out.o - r0);
    moejax::qrows_dot(out.q, out.w + r0 * out.row_bytes, rows, out.row_bytes,
                      acts[out.q], tok.data(), n, out.acc.data() + r0, out.o);
  };
  const int64_t num = static_cast<int64_t>(items.size());
  if (bytes < kSerialBytes) {
    for (int64_t it = 0; it < num; ++it) run(it);
  } else {
    moejax::parallel_for(pool, num, run, n <= kDecodeTokens);
  }
  for (Out& out : outs) store(out.acc.data(), n * out.o, bf16, out.y);
  return ffi::Error::Success();
}

ffi::Error LinearQImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                       ffi::RemainingRets ys, ffi::Span<const int32_t> qtypes) {
  return LinearQCore(pool, x, ws, ys, qtypes, -1);
}

ffi::Error LinearQAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer x,
                         ffi::RemainingArgs ws, ffi::RemainingRets ys,
                         ffi::Span<const int32_t> qtypes) {
  return LinearQCore(pool, x, ws, ys, qtypes, moejax::layer_of(layer));
}

struct Item {
  int64_t expert, begin, end;   // a run of pairs in the expert-sorted order
};

// The routed experts' problem: gate and up rows [E, I, Bd] (one buffer [E, 2I, Bd] when
// fused: up = gate + I rows), down rows [E, D, Bi].
struct QExperts {
  int64_t n, k, d, inter, ne;
  int qgu, qdn;
  int64_t gu_rb, dn_rb;                    // bytes of a gate/up row, a down row
  const uint8_t *gate, *up, *down;
  int64_t gate_es, up_es, down_es;         // bytes between experts
  const float* gates;
  QAct xa;                                 // the N tokens, quantized for gate/up
  std::vector<int64_t> order, tok;         // pair indices sorted by expert; their tokens
  std::vector<Item> items;
  std::vector<float> pair_out;             // [n * k, d], gate applied
};

// The activations a[t, :] (nt pairs from sorted position `first`) of the expert's gate/up
// rows j0 .. j0 + nj: silu(gate . x) * (up . x).
void act_rows(const QExperts& p, const Item& it, int64_t first, int64_t nt, int64_t j0,
              int64_t nj, float* a, int64_t as) {
  thread_local std::vector<float> g, u;
  g.resize(nt * nj);
  u.resize(nt * nj);
  const int64_t* tok = p.tok.data() + first;
  moejax::qrows_dot(p.qgu, p.gate + it.expert * p.gate_es + j0 * p.gu_rb, nj, p.gu_rb, p.xa,
                    tok, nt, g.data(), nj);
  moejax::qrows_dot(p.qgu, p.up + it.expert * p.up_es + j0 * p.gu_rb, nj, p.gu_rb, p.xa,
                    tok, nt, u.data(), nj);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t j = 0; j < nj; ++j) a[t * as + j] = silu_mul(g[t * nj + j], u[t * nj + j]);
}

// pair_out rows of pairs first .. first + nt: gate * (down rows r0 .. r0 + nr) . a, where a
// holds those pairs' activations quantized (rows a_first on).
void down_rows(QExperts& p, const Item& it, int64_t first, int64_t nt, const QAct& a,
               int64_t a_first, int64_t r0, int64_t nr) {
  thread_local std::vector<float> y;
  thread_local std::vector<int64_t> rows;
  y.resize(nt * nr);
  rows.resize(nt);
  std::iota(rows.begin(), rows.end(), a_first);
  moejax::qrows_dot(p.qdn, p.down + it.expert * p.down_es + r0 * p.dn_rb, nr, p.dn_rb, a,
                    rows.data(), nt, y.data(), nr);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t pair = p.order[first + t];
    const float gate = p.gates[pair];
    for (int64_t j = 0; j < nr; ++j) p.pair_out[pair * p.d + r0 + j] = gate * y[t * nr + j];
  }
}

// A prompt's item: both matmuls of one expert for its block of tokens.
void run_item(QExperts& p, const Item& it) {
  const int64_t nt = it.end - it.begin;
  thread_local std::vector<float> a;
  thread_local QAct aq;
  a.resize(nt * p.inter);
  act_rows(p, it, it.begin, nt, 0, p.inter, a.data(), p.inter);
  moejax::qact_reset(aq, p.qdn, nt, p.inter);
  for (int64_t t = 0; t < nt; ++t) moejax::qact_row(a.data() + t * p.inter, aq, t);
  down_rows(p, it, it.begin, nt, aq, 0, 0, p.d);
}

// A decode call in finer items: (block, 32 gate/up rows), then every pair's activations
// quantized, then (block, 64 down rows). Each row's dot is as run_item computes it.
void decode_phases(ffi::ThreadPool& pool, QExperts& p) {
  const int64_t pairs = static_cast<int64_t>(p.order.size()), items = p.items.size();
  std::vector<float> a(pairs * p.inter);
  const int64_t c1 = (p.inter + kActChunk - 1) / kActChunk, c2 = (p.d + kDownChunk - 1) / kDownChunk;
  moejax::parallel_for(pool, items * c1, [&](int64_t q) {
    const Item& it = p.items[q / c1];
    const int64_t j0 = (q % c1) * kActChunk, nj = std::min(kActChunk, p.inter - j0);
    act_rows(p, it, it.begin, it.end - it.begin, j0, nj, a.data() + it.begin * p.inter + j0,
             p.inter);
  }, true);
  QAct aq;
  moejax::qact_reset(aq, p.qdn, pairs, p.inter);
  for (int64_t t = 0; t < pairs; ++t) moejax::qact_row(a.data() + t * p.inter, aq, t);
  moejax::parallel_for(pool, items * c2, [&](int64_t q) {
    const Item& it = p.items[q / c2];
    const int64_t r0 = (q % c2) * kDownChunk;
    down_rows(p, it, it.begin, it.end - it.begin, aq, it.begin, r0, std::min(kDownChunk, p.d - r0));
  }, true);
}

// The pairs sorted by expert (ids clamped like XLA's dynamic indexing; gate-0 pairs left
// out: their output stays 0) and cut into blocks of up to kBlock tokens.
void sort_pairs(QExperts& p, const int32_t* ids) {
  const int64_t pairs = p.n * p.k, ne = p.ne;
  std::vector<int64_t> count(ne + 1, 0), expert_of(pairs, -1);
  for (int64_t i = 0; i < pairs; ++i) {
    if (p.gates[i] == 0.0f) continue;
    expert_of[i] = std::min<int64_t>(std::max<int64_t>(ids[i], 0), ne - 1);
    ++count[expert_of[i] + 1];
  }
  for (int64_t e = 0; e < ne; ++e) count[e + 1] += count[e];
  p.order.resize(count[ne]);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < pairs; ++i)
    if (expert_of[i] >= 0) p.order[fill[expert_of[i]]++] = i;
  p.tok.resize(p.order.size());
  for (size_t i = 0; i < p.order.size(); ++i) p.tok[i] = p.order[i] / p.k;
  for (int64_t e = 0; e < ne; ++e) {
    const int64_t c = count[e + 1] - count[e], nb = (c + kBlock - 1) / kBlock;
    for (int64_t i = 0; i < nb; ++i)
      p.items.push_back({e, count[e] + c * i / nb, count[e] + c * (i + 1) / nb});
  }
}

// Binds the weight operands: (gate_up [E, 2I, Bd], down) or (gate, up [E, I, Bd], down).
ffi::Error bind_weights(QExperts& p, ffi::RemainingArgs ws, int64_t layer) {
  const size_t nw = ws.size();
  if (nw != 2 && nw != 3)
    return ffi::Error::InvalidArgument("moejax_expert_ffn_q: weights (gate_up, down) or "
                                       "(gate, up, down)");
  std::vector<moejax::Slab> s;
  for (size_t i = 0; i < nw; ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || w->element_type() != ffi::DataType::U8 ||
        w->dimensions().size() != (layer >= 0 ? 4u : 3u))
      return ffi::Error::InvalidArgument("moejax_expert_ffn_q: weights are uint8 [E, O, B] "
                                         "(or [L, E, O, B] with a layer)");
    s.push_back(moejax::slab(*w, layer));
  }
  const moejax::Slab& dn = s.back();
  p.ne = s[0].dims[0];
  p.inter = nw == 2 ? s[0].dims[1] / 2 : s[0].dims[1];
  p.gu_rb = p.d / moejax::qblock_elems(p.qgu) * moejax::qblock_bytes(p.qgu);
  p.dn_rb = p.inter / moejax::qblock_elems(p.qdn) * moejax::qblock_bytes(p.qdn);
  bool ok = p.d % moejax::qblock_elems(p.qgu) == 0 && p.inter % moejax::qblock_elems(p.qdn) == 0;
  for (size_t i = 0; i + 1 < nw; ++i)
    ok = ok && s[i].dims[0] == p.ne && s[i].dims[1] == (nw == 2 ? 2 : 1) * p.inter &&
         s[i].dims[2] == p.gu_rb;
  ok = ok && dn.dims[0] == p.ne && dn.dims[1] == p.d && dn.dims[2] == p.dn_rb;
  if (!ok)
    return ffi::Error::InvalidArgument("moejax_expert_ffn_q: expert shapes do not match x and "
                                       "the qtypes (D and I multiples of the blocks)");
  p.gate = static_cast<const uint8_t*>(s[0].data);
  p.gate_es = s[0].dims[1] * p.gu_rb;
  p.up = nw == 2 ? p.gate + p.inter * p.gu_rb : static_cast<const uint8_t*>(s[1].data);
  p.up_es = nw == 2 ? p.gate_es : s[1].dims[1] * p.gu_rb;
  p.down = static_cast<const uint8_t*>(dn.data);
  p.down_es = p.d * p.dn_rb;
  return ffi::Error::Success();
}

ffi::Error ExpertFfnQCore(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::F32> gates, ffi::RemainingArgs ws,
                          ffi::Result<ffi::AnyBuffer> y, int32_t qgu, int32_t qdn,
                          int64_t layer) {
  auto xd = x.dimensions(), idd = ids.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || idd[0] != xd[0] || !x_ok(x.element_type()) ||
      y->element_type() != x.element_type() || !moejax::qtype_ok(qgu) ||
      !moejax::qtype_ok(qdn))
    return ffi::Error::InvalidArgument("moejax_expert_ffn_q: expected x [N,D] (f32 or bf16), "
                                       "ids [N,K], y like x, qtypes 0-3");
  auto p = std::make_unique<QExperts>();
  p->n = xd[0];
  p->d = xd[1];
  p->k = idd[1];
  p->qgu = qgu;
  p->qdn = qdn;
  p->gates = gates.typed_data();
  if (ffi::Error e = bind_weights(*p, ws, layer); e.failure()) return e;
  const bool bf16 = is_bf16(x.element_type());
  sort_pairs(*p, ids.typed_data());
  quantize_x(pool, x.untyped_data(), bf16, p->n, p->d, qgu, p->xa);
  p->pair_out.assign(p->n * p->k * p->d, 0.0f);
  QExperts& prob = *p;
  if (p->n <= kDecodeTokens) {
    decode_phases(pool, prob);
  } else {
    moejax::parallel_for(pool, static_cast<int64_t>(p->items.size()),
                         [&prob](int64_t i) { run_item(prob, prob.items[i]); }, false);
  }
  std::vector<float> acc(p->d);
  for (int64_t t = 0; t < p->n; ++t) {   // each token's k outputs, added in order
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t q = 0; q < p->k; ++q) {
      const float* src = p->pair_out.data() + (t * p->k + q) * p->d;
      for (int64_t j = 0; j < p->d; ++j) acc[j] += src[j];
    }
    store(acc.data(), p->d, bf16, static_cast<char*>(y->untyped_data()) + t * p->d * (bf16 ? 2 : 4));
  }
  return ffi::Error::Success();
}

ffi::Error ExpertFfnQImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::F32> gates, ffi::RemainingArgs ws,
                          ffi::Result<ffi::AnyBuffer> y, int32_t qgu, int32_t qdn) {
  return ExpertFfnQCore(pool, x, ids, gates, ws, y, qgu, qdn, -1);
}

ffi::Error ExpertFfnQAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> gates,
                            ffi::RemainingArgs ws, ffi::Result<ffi::AnyBuffer> y, int32_t qgu,
                            int32_t qdn) {
  return ExpertFfnQCore(pool, x, ids, gates, ws, y, qgu, qdn, moejax::layer_of(layer));
}

}  // namespace

// Which instructions the quantized dots use: "avx512-vnni", "avx2" or "scalar".
extern "C" const char* moejax_qdot_isa() { return moejax::qdot_isa(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxLinearQ, LinearQImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .RemainingArgs().RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("qtypes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxLinearQAt, LinearQAtImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::AnyBuffer>()
                                  .RemainingArgs().RemainingRets()
                                  .Attr<ffi::Span<const int32_t>>("qtypes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxExpertFfnQ, ExpertFfnQImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("qtype_gu").Attr<int32_t>("qtype_down"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxExpertFfnQAt, ExpertFfnQAtImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("qtype_gu").Attr<int32_t>("qtype_down"));
