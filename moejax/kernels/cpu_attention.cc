// Decode-time attention over a static KV cache for XLA's CPU backend, called through jax.ffi
// (built into the same library as cpu_kernel.cc).
//
//   o[n, t, h] = sum_j p_j v[n, j, g(h)],  p = softmax_j((q[n, t, h] . k[n, j, g(h)]) * scale)
//
// over the cache positions j with lo <= j <= q_pos[n, t] (lo = q_pos - window + 1 with a
// sliding window, else 0), f32 throughout; an optional learned sink logit per head joins
// the softmax's denominator (GPT-OSS).  The cache is read in place: [..., S, G, K] keys
// and [..., S, G, V] values, q [..., T, H, K], H a multiple of G.  XLA's own path copies the key
// cache into the score dot's layout at every decode step and runs the masked softmax over
// all S positions as several small kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_dot.h"
#include "cpu_layer.h"
#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moejax::dot_row;
using moejax::to_bf16;
using moejax::to_f32;

// One query (token t, head h) of one row: o[vd] = softmax over the visible positions.
template <typename C>
void attend_head(const float* qh, const C* kc, const C* vc, int64_t s_len, int64_t g_num,
                 int64_t kd, int64_t vd, int64_t g, int64_t pos, float scale, int64_t window,
                 const float* sink_h, float* score, float* acc, float* o) {
  int64_t hi = std::min<int64_t>(pos, s_len - 1), lo = window > 0 ? pos - window + 1 : 0;
  lo = std::max<int64_t>(lo, 0);
  const bool none = hi < lo;   // nothing visible: XLA's masked softmax is uniform over S
  if (none) {
    lo = 0;
    hi = s_len - 1;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j <= hi; ++j) {
    const float s = none ? 0.0f : dot_row(kc + (j * g_num + g) * kd, qh, kd) * scale;
    score[j] = s;
    m = std::max(m, s);
  }
  const float sink = sink_h ? *sink_h : -std::numeric_limits<float>::infinity();
  m = std::max(m, sink);
  float denom = sink_h ? std::exp(sink - m) : 0.0f;
  std::fill(acc, acc + vd, 0.0f);
  for (int64_t j = lo; j <= hi; ++j) {
    const float e = std::exp(score[j] - m);
    denom += e;
    const C* vj = vc + (j * g_num + g) * vd;
    for (int64_t d = 0; d < vd; ++d) acc[d] += e * to_f32(vj[d]);
  }
  for (int64_t d = 0; d < vd; ++d) o[d] = acc[d] / denom;
}

// Rows x tokens x heads queries are independent: below this many multiply-adds (about
// 20 us) they run on the calling thread, above it on the pool (a batch's rows, a long
// context's heads).
constexpr int64_t kAttentionSerialMacs = 1 << 16;

ffi::Error DecodeAttentionCore(ffi::ThreadPool pool, ffi::AnyBuffer q, const moejax::Slab& k,
                               const moejax::Slab& v,
                               ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::F32> sinks,
                               float scale, int64_t window, int64_t has_sinks,
                               ffi::Result<ffi::AnyBuffer> o_) {
  // leading dims (batch, and a vmap's axis in front) are flattened into N
  auto qd = q.dimensions(), pd = qpos.dimensions();
  const auto& kd = k.dims;
  const auto& vd = v.dims;
  const size_t r = qd.size();
  if (r < 3 || kd.size() != r || vd.size() != r || pd.size() != r - 2)
    return ffi::Error::InvalidArgument("moejax_decode_attention: expected q [...,T,H,K], "
                                       "k [...,S,G,K], v [...,S,G,V], q_pos [...,T]");
  int64_t n = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (kd[i] != qd[i] || vd[i] != qd[i] || pd[i] != qd[i])
      return ffi::Error::InvalidArgument("moejax_decode_attention: batch dims differ");
    n *= qd[i];
  }
  const int64_t t_len = qd[r - 3], hq = qd[r - 2], kdim = qd[r - 1];
  const int64_t s_len = kd[r - 3], g_num = kd[r - 2], vdim = vd[r - 1];
  if (kd[r - 1] != kdim || vd[r - 3] != s_len || vd[r - 2] != g_num || pd[r - 3] != t_len ||
      g_num == 0 || hq % g_num != 0 ||
      (has_sinks && (sinks.element_count() % hq != 0 || sinks.element_count() == 0)))
    return ffi::Error::InvalidArgument("moejax_decode_attention: shapes do not match");
  const bool q_bf16 = q.element_type() == ffi::DataType::BF16;
  const bool c_bf16 = k.type == ffi::DataType::BF16;
  if ((!q_bf16 && q.element_type() != ffi::DataType::F32) ||
      (!c_bf16 && k.type != ffi::DataType::F32) ||
      v.type != k.type || o_->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("moejax_decode_attention: f32 or bf16 only");
  const int64_t qn = t_len * hq * kdim, on = t_len * hq * vdim;
  const int64_t kn = s_len * g_num * kdim, vn = s_len * g_num * vdim;
  // sinks [H], or [R, H] when a vmap broadcast them (rows over the leading axis)
  const int64_t sink_rows = has_sinks ? sinks.element_count() / hq : 0;
  int64_t macs = 0;
  for (int64_t i = 0; i < n * t_len; ++i)
    macs += (std::min<int64_t>(qpos.typed_data()[i], s_len - 1) + 1) * hq * (kdim + vdim);
  // one item: the query (row b, token t, head h), in its own row of qf and of
  std::vector<float> qf(n * qn), of(n * on);
  auto item = [&](int64_t it) {
    thread_local std::vector<float> score, acc;   // this thread's scratch, kept across calls
    score.resize(s_len);
    acc.resize(vdim);
    const int64_t b = it / (t_len * hq), t = (it / hq) % t_len, h = it % hq;
    const int64_t qi = (b * t_len + t) * hq + h;
    float* qh = qf.data() + qi * kdim;
    if (q_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(q.untyped_data()) + qi * kdim;
      for (int64_t i = 0; i < kdim; ++i) qh[i] = to_f32(src[i]);
    } else {
      std::memcpy(qh, static_cast<const float*>(q.untyped_data()) + qi * kdim,
                  kdim * sizeof(float));
    }
    const float* sk = has_sinks ? sinks.typed_data() + (b * sink_rows / n) * hq + h : nullptr;
    const int64_t pos = qpos.typed_data()[b * t_len + t], g = h / (hq / g_num);
    float* o = of.data() + qi * vdim;
    if (c_bf16)
      attend_head(qh, static_cast<const uint16_t*>(k.data) + b * kn,
                  static_cast<const uint16_t*>(v.data) + b * vn, s_len, g_num, kdim, vdim, g,
                  pos, scale, window, sk, score.data(), acc.data(), o);
    else
      attend_head(qh, static_cast<const float*>(k.data) + b * kn,
                  static_cast<const float*>(v.data) + b * vn, s_len, g_num, kdim, vdim, g,
                  pos, scale, window, sk, score.data(), acc.data(), o);
    if (q_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(o_->untyped_data()) + qi * vdim;
      for (int64_t i = 0; i < vdim; ++i) dst[i] = to_bf16(o[i]);
    } else {
      std::memcpy(static_cast<float*>(o_->untyped_data()) + qi * vdim, o, vdim * sizeof(float));
    }
  };
  const int64_t items = n * t_len * hq;
  if (macs < kAttentionSerialMacs || items < 2) {
    for (int64_t it = 0; it < items; ++it) item(it);
  } else {
    moejax::parallel_for(pool, items, item, true);
  }
  return ffi::Error::Success();
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> qpos,
                               ffi::Buffer<ffi::F32> sinks, float scale, int64_t window,
                               int64_t has_sinks,
                               ffi::Result<ffi::AnyBuffer> o) {
  return DecodeAttentionCore(pool, q, moejax::slab(k, -1), moejax::slab(v, -1), qpos, sinks,
                             scale, window, has_sinks, o);
}

// Over layer `layer` of a stacked cache: k [L, ..., S, G, K], v [L, ..., S, G, V].
ffi::Error DecodeAttentionAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                                 ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::F32> sinks,
                                 float scale, int64_t window, int64_t has_sinks,
                                 ffi::Result<ffi::AnyBuffer> o) {
  const int64_t l = moejax::layer_of(layer);
  return DecodeAttentionCore(pool, q, moejax::slab(k, l), moejax::slab(v, l), qpos, sinks,
                             scale, window, has_sinks, o);
}

// The decode attention's operands after what `b` binds first: q, k, v, q_pos [S32],
// sinks [F32], its attributes -> o.
template <typename B>
auto attention_operands(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("scale")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("has_sinks")
      .template Ret<ffi::AnyBuffer>();
}

}  // namespace

// the layer of the stacked cache first (an int32 scalar)
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxDecodeAttentionAt, DecodeAttentionAtImpl,
                              attention_operands(ffi::Ffi::Bind()
                                                     .Ctx<ffi::ThreadPool>()
                                                     .Arg<ffi::Buffer<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxDecodeAttention, DecodeAttentionImpl,
                              attention_operands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
