// Row-wise ops of a decode step as one XLA CPU custom call each (through jax.ffi): an
// RMSNorm, the softmax router rule (softmax, top-k, renormalisation), a top-k, a weighted
// bincount and a bf16 embedding lookup (take_rows). XLA's CPU
// emitters do not fuse a reduction with its elementwise consumers, so each of them
// compiles to 3-6 thunks, each with a fixed cost of a microsecond or so; a decode step of a
// small model has hundreds (docs/speed.md). All run on the calling thread (a decode
// step's rows are a few hundred floats) but copy_rows, whose block is a whole expert.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_pages.h"
#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moejax::to_bf16;
using moejax::to_f32;

// y = w * dtype(x * rsqrt(mean(x^2) + eps)), x's mean over its last axis in f32, like
// HF's (and layers.rms_norm's) RMSNorm; W is float or uint16_t (bf16).
template <typename W>
void rms_rows(const W* x, const W* w, int64_t rows, int64_t d, float eps, W* y) {
  std::vector<float> xf(d);
  for (int64_t r = 0; r < rows; ++r) {
    const W* xr = x + r * d;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j < d; ++j) {
      xf[j] = to_f32(xr[j]);
      acc[j & 7] += xf[j] * xf[j];
    }
    const float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    W* yr = y + r * d;
    for (j = 0; j < d; ++j) {
      if constexpr (sizeof(W) == 2) {  // bf16: the normed row is rounded, then multiplied
        yr[j] = to_bf16(to_f32(w[j]) * to_f32(to_bf16(xf[j] * inv)));
      } else {
        yr[j] = w[j] * (xf[j] * inv);
      }
    }
  }
}

ffi::Error RmsNormImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, float eps,
                       ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions();
  const auto t = x.element_type();
  if (xd.size() != 2 || w.element_count() != static_cast<size_t>(xd[1]) ||
      w.element_type() != t || y->element_type() != t ||
      (t != ffi::DataType::F32 && t != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(
        "moejax_rms_norm: expected x [R,D] and w [D] of one dtype, f32 or bf16");
  if (t == ffi::DataType::F32)
    rms_rows(static_cast<const float*>(x.untyped_data()),
             static_cast<const float*>(w.untyped_data()), xd[0], xd[1], eps,
             static_cast<float*>(y->untyped_data()));
  else
    rms_rows(static_cast<const uint16_t*>(x.untyped_data()),
             static_cast<const uint16_t*>(w.untyped_data()), xd[0], xd[1], eps,
             static_cast<uint16_t*>(y->untyped_data()));
  return ffi::Error::Success();
}

// The K largest of x[0..E) in descending order with their indices, ties to the lower index
// (jax.lax.top_k's order), by insertion into a sorted list of K: about E compares, where
// XLA CPU's TopK sorts a copy of the row. Inputs are router scores or -inf, never NaN
// (XLA orders NaN above +inf; this does not).
void top_k_row(const float* x, int64_t e, int64_t k, float* v, int32_t* ix) {
  int64_t n = 0;
  for (int64_t j = 0; j < e && k > 0; ++j) {
    const float a = x[j];
    if (n == k && !(a > v[k - 1])) continue;      // an equal value keeps the lower index
    int64_t p = n < k ? n++ : k - 1;
    for (; p > 0 && a > v[p - 1]; --p) {
      v[p] = v[p - 1];
      ix[p] = ix[p - 1];
    }
    v[p] = a;
    ix[p] = static_cast<int32_t>(j);
  }
}

// Per row of logits [R, E]: scores = softmax(logits); ids = the K highest scores, in
// descending order, ties to the lower index (jax.lax.top_k's order); gates = their scores,
// divided by their sum when `renorm`.
ffi::Error RouteSoftmaxImpl(ffi::Buffer<ffi::F32> logits, int64_t renorm,
                            ffi::Result<ffi::Buffer<ffi::S32>> ids,
                            ffi::Result<ffi::Buffer<ffi::F32>> gates,
                            ffi::Result<ffi::Buffer<ffi::F32>> scores) {
  auto ld = logits.dimensions(), id = ids->dimensions();
  if (ld.size() != 2 || id.size() != 2 || id[0] != ld[0] || id[1] > ld[1] ||
      gates->element_count() != ids->element_count() ||
      scores->element_count() != logits.element_count())
    return ffi::Error::InvalidArgument(
        "moejax_route_softmax: expected logits [R,E], ids and gates [R,K], scores [R,E]");
  const int64_t rows = ld[0], e = ld[1], k = id[1];
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits.typed_data() + r * e;
    float* s = scores->typed_data() + r * e;
    float m = l[0];
    for (int64_t j = 1; j < e; ++j) m = std::max(m, l[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < e; ++j) {
      s[j] = std::exp(l[j] - m);
      sum += s[j];
    }
    for (int64_t j = 0; j < e; ++j) s[j] /= sum;
    int32_t* ir = ids->typed_data() + r * k;
    float* gr = gates->typed_data() + r * k;
    top_k_row(s, e, k, gr, ir);
    float top = 0.0f;
    for (int64_t j = 0; j < k; ++j) top += gr[j];
    if (renorm)
      for (int64_t j = 0; j < k; ++j) gr[j] /= top;
  }
  return ffi::Error::Success();
}

// Per row of x [R, E]: `top_k_row` (values and indices, as jax.lax.top_k).
ffi::Error TopKImpl(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> vals,
                    ffi::Result<ffi::Buffer<ffi::S32>> idx) {
  auto xd = x.dimensions(), vd = vals->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[0] || vd[1] > xd[1] || vd[1] < 1 ||
      idx->element_count() != vals->element_count())
    return ffi::Error::InvalidArgument(
        "moejax_top_k: expected x [R,E], values and indices [R,K] with 1 <= K <= E");
  const int64_t rows = xd[0], e = xd[1], k = vd[1];
  for (int64_t r = 0; r < rows; ++r)
    top_k_row(x.typed_data() + r * e, e, k, vals->typed_data() + r * k,
              idx->typed_data() + r * k);
  return ffi::Error::Success();
}

// Per row: out[r, ids[r, k]] += w[r, k] over k in order, from 0 (ids outside [0, E) add
// nothing): a weighted bincount into E bins, where XLA CPU materialises the [K, E] one-hot
// and reduces it over its first axis (11% of a simulator sweep).
ffi::Error BinSumImpl(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
                      ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto id = ids.dimensions(), od = out->dimensions();
  if (id.size() != 2 || od.size() != 2 || od[0] != id[0] ||
      w.element_count() != ids.element_count())
    return ffi::Error::InvalidArgument(
        "moejax_bin_sum: expected ids and weights [R,K] and out [R,E]");
  const int64_t rows = id[0], k = id[1], e = od[1];
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out->typed_data() + r * e;
    std::fill(o, o + e, 0.0f);
    const int32_t* ir = ids.typed_data() + r * k;
    const float* wr = w.typed_data() + r * k;
    for (int64_t j = 0; j < k; ++j)
      if (ir[j] >= 0 && ir[j] < e) o[ir[j]] += wr[j];
  }
  return ffi::Error::Success();
}

// rows[n] = table[ids[n]] for a bf16 table [V, D], with jnp.take's default semantics: a
// negative id counts from the end, and an id still out of [0, V) gives a row of NaN.
// XLA fuses the same gather with the bitcast that reads bf16 as uint16 (or with a convert
// to f32) over the whole table, and its cost model then splits the tiny lookup over the
// thread pool at every decode step (docs/speed.md, "The bf16 embedding lookup").
ffi::Error TakeRowsImpl(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer table,
                        ffi::Result<ffi::AnyBuffer> rows) {
  auto td = table.dimensions();
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (td.size() != 2 || table.element_type() != ffi::DataType::BF16 ||
      rows->element_type() != ffi::DataType::BF16 ||
      static_cast<int64_t>(rows->element_count()) != n * td[1])
    return ffi::Error::InvalidArgument(
        "moejax_take_rows: expected ids [N], a bf16 table [V,D] and rows [N,D]");
  const int64_t v = td[0], d = td[1];
  const uint16_t* src = static_cast<const uint16_t*>(table.untyped_data());
  uint16_t* dst = static_cast<uint16_t*>(rows->untyped_data());
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = ids.typed_data()[i];
    if (id < 0) id += v;
    if (id < 0 || id >= v) std::fill(dst + i * d, dst + (i + 1) * d, uint16_t{0x7fc0});  // NaN
    else std::memcpy(dst + i * d, src + id * d, d * sizeof(uint16_t));
  }
  return ffi::Error::Success();
}

// out = lax.dynamic_update_slice(x, rows, (i0, .., ik-1, 0, ...)) for rows whose dims from
// k on are x's (a KV cache [B, S, ...] at (b, s); a stacked one [L, B, S, ...] at (l, b, s);
// slot buffers [L, P, ...] at (l, slot)), written in place: `out` is `x`'s buffer
// (input_output_aliases). The start is clamped as XLA clamps it. XLA's CPU backend updated a
// 16-bit float array through f32, or its uint16 view fused with the bitcasts back: a loop
// over the whole array (a KV cache at every decode step).
ffi::Error WriteRowsImpl(ffi::AnyBuffer x, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> start,
                         ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), rd = rows.dimensions();
  const size_t k = start.element_count();
  const int64_t width = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  bool ok = k >= 1 && k <= xd.size() && xd.size() == rd.size() &&
            rows.element_type() == x.element_type() && out->element_type() == x.element_type();
  for (size_t i = 0; ok && i < xd.size(); ++i) ok = i < k ? rd[i] <= xd[i] : rd[i] == xd[i];
  if (!ok)
    return ffi::Error::InvalidArgument(
        "moejax_write_rows: expected rows of x's dtype, no larger than x in its first k dims "
        "and equal to it after them, and a start of k indices");
  int64_t row = width, outer = 1;              // bytes after the k dims; row blocks
  for (size_t i = k; i < xd.size(); ++i) row *= xd[i];
  for (size_t i = 0; i + 1 < k; ++i) outer *= rd[i];
  std::vector<int64_t> s0(k);
  for (size_t i = 0; i < k; ++i)
    s0[i] = std::clamp<int64_t>(start.typed_data()[i], 0, xd[i] - rd[i]);
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != x.untyped_data())   // not aliased (never expected): the rest copied first
    std::memcpy(dst, x.untyped_data(), x.size_bytes());
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int64_t block = rd[k - 1] * row;       // contiguous in both: dim k-1's rows
  for (int64_t o = 0; o < outer; ++o) {
    int64_t at = 0, rest = o;
    std::vector<int64_t> j(k, 0);
    for (size_t i = k - 1; i-- > 0;) {          // o as an index over rows' dims 0..k-2
      j[i] = rest % rd[i];
      rest /= rd[i];
    }
    for (size_t i = 0; i < k; ++i) at = at * xd[i] + s0[i] + j[i];
    std::memcpy(dst + at * row, src + o * block, block);
  }
  return ffi::Error::Success();
}

// out = dst with src's block at src_start written at dst_start, in place (out is dst's
// buffer): a block is one index of each of the first kd (ks) dims and all of the rest, which
// are the same in both (slot buffers [L, P, ...] at (l, slot), an expert store [L, E, ...]
// at (l, e)); starts clamped as XLA clamps them. One stored expert into its slot is one
// copy from the store's buffer: XLA slices it out into a buffer of its own first, and the
// update then copies it again. A block of 512 KB or more is split over the pool in pieces
// of about 256 KB: one thread copies 6.6 GB/s from a mapped file on this VM, two 10.9
// (a Q8_0 expert's 1.67 MB tensors were one piece each at the former 1 MB a piece).
constexpr int64_t kCopyPiece = 1 << 18;

int64_t block_at(ffi::Span<const int64_t> dims, const int32_t* start, size_t k) {
  int64_t at = 0;
  for (size_t i = 0; i < k; ++i)
    at = at * dims[i] + std::clamp<int64_t>(start[i], 0, dims[i] - 1);
  return at;
}

ffi::Error CopyRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                        ffi::Buffer<ffi::S32> dst_start, ffi::Buffer<ffi::S32> src_start,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto dd = dst.dimensions(), sd = src.dimensions();
  const size_t kd = dst_start.element_count(), ks = src_start.element_count();
  bool ok = kd >= 1 && kd <= dd.size() && ks >= 1 && ks <= sd.size() &&
            dd.size() - kd == sd.size() - ks &&
            ffi::ByteWidth(dst.element_type()) == ffi::ByteWidth(src.element_type()) &&
            out->element_type() == dst.element_type();
  for (size_t i = 0; ok && kd + i < dd.size(); ++i) ok = dd[kd + i] == sd[ks + i];
  if (!ok)
    return ffi::Error::InvalidArgument(
        "moejax_copy_rows: expected blocks of the same shape and byte width after the kd and "
        "ks indexed dims");
  int64_t block = static_cast<int64_t>(ffi::ByteWidth(dst.element_type()));
  for (size_t i = kd; i < dd.size(); ++i) block *= dd[i];
  char* o = static_cast<char*>(out->untyped_data());
  if (o != dst.untyped_data())   // not aliased (never expected): the rest copied first
    std::memcpy(o, dst.untyped_data(), dst.size_bytes());
  char* to = o + block_at(dd, dst_start.typed_data(), kd) * block;
  const char* from =
      static_cast<const char*>(src.untyped_data()) + block_at(sd, src_start.typed_data(), ks) * block;
  // a multiple of the pool's threads, so that each copies as much (a Q4_0 expert's 0.88 MB
  // tensors: 4 pieces, not 3, of which one thread copied 2)
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t pieces = std::max<int64_t>(1, block / kCopyPiece);
  if (pieces > 1) pieces = (pieces + threads - 1) / threads * threads;
  const int64_t piece = (block + pieces - 1) / pieces;
  auto one = [&](int64_t i) {
    const int64_t a = i * piece, n = std::min(block, a + piece) - a;
    if (n > 0) std::memcpy(to + a, from + a, n);
  };
  if (pieces == 1) one(0);
  else moejax::parallel_for(pool, pieces, one, true);
  return ffi::Error::Success();
}

// n_out = n, after asking the OS to read blocks at_JxK[j] (j < n; blocks as copy_rows's)
// of src into the page cache, all at once (cpu_pages.h): a copy_rows loop bounded by n_out
// then finds a memory-mapped store's blocks read or in flight. On this VM's disk 9.4 MB
// blocks came in at 0.86-1.03 GB/s by page faults, 1.65-1.70 GB/s after the hint.
ffi::Error WillNeedImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> at_JxK,
                        ffi::Buffer<ffi::S32> n, ffi::Result<ffi::Buffer<ffi::S32>> n_out) {
  auto sd = src.dimensions(), ad = at_JxK.dimensions();
  if (ad.size() != 2 || ad[1] < 1 || static_cast<size_t>(ad[1]) > sd.size() ||
      n.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "moejax_will_need: expected starts [J, k] with k <= src's rank, and a count");
  const size_t k = static_cast<size_t>(ad[1]);
  int64_t block = static_cast<int64_t>(ffi::ByteWidth(src.element_type()));
  for (size_t i = k; i < sd.size(); ++i) block *= sd[i];
  const int32_t count = std::clamp<int32_t>(n.typed_data()[0], 0, static_cast<int32_t>(ad[0]));
  const char* base = static_cast<const char*>(src.untyped_data());
  for (int32_t j = 0; j < count; ++j)
    moejax::will_need(base + block_at(sd, at_JxK.typed_data() + j * k, k) * block, block);
  n_out->typed_data()[0] = n.typed_data()[0];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxTakeRows, TakeRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxWriteRows, WriteRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxBinSum, BinSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxRouteSoftmax, RouteSoftmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("renorm")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxCopyRows, CopyRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxWillNeed, WillNeedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
