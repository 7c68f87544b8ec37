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

using moejax::to_bf16;
using moejax::to_f32;

// Heads read together: the query heads of one KV group (up to this many at a time) share
// each key and value row, widened to f32 once for all of them (GQA: 8 heads a group at
// Qwen3-30B-A3B's width).
constexpr int kHeadsTogether = 8;
// Positions a value pass covers before the next chunk of the head dimension: the lines
// of a group's values for this many positions (64 KB in bf16 at head dim 128) stay near
// L1 across the chunks (256: 396-480 us a call at 2000 positions, 512: 456-503).
constexpr int64_t kValueTile = 256;

// Positions ahead whose key and value lines are prefetched: one group's rows are kd (or vd)
// of every g_num * kd elements, a stride the hardware prefetcher followed poorly (a cold
// cache read at ~3.7 GB/s, 954 us a call at position 1700 of wide_bf16).
constexpr int64_t kAhead = 8;

using moejax::v8f;

// exp(x) for x <= 0, eight lanes (Cephes' expf: 2^n times a degree-7 polynomial of the
// rest, about 1 ulp); lanes below -87.3 give 0, a NaN stays NaN.
inline v8f exp8(v8f x) {
  const v8f low = x < -87.3f ? v8f{} - 1.0f : v8f{};
  const v8f xc = x < -87.3f ? v8f{} - 87.3f : x;
  const v8f n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round
  v8f r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v8f y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  typedef int32_t v8i __attribute__((vector_size(32)));
  const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return low != 0.0f ? v8f{} : y * scale;
}

// Lane i: the sum of a[i]'s lanes, ((0+1)+(2+3))+((4+5)+(6+7)) (AVX's hadd tree): eight
// heads' dot products reduced together.
inline v8f reduce8(const v8f (&a)[8]) {
  auto hadd = [](v8f x, v8f y) -> v8f {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8f u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
  const v8f u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Lane i < NH: q[i, :] . k[:] (q: NH rows of kd); one 8-lane chain a head over the row's
// chunks in order, reduce8's tree, then the tail in order.  Lanes from NH on are 0.
template <int NH, typename C>
inline v8f group_scores(const C* k, const float* q, int64_t kd) {
  const int64_t nc = kd / 8;
  v8f a[8] = {};
  for (int64_t c = 0; c < nc; ++c) {
    const v8f kv = moejax::load8(k + c * 8);
    for (int i = 0; i < NH; ++i) a[i] = moejax::fma8(moejax::load8(q + i * kd + c * 8), kv, a[i]);
  }
  v8f s = reduce8(a);
  for (int64_t d = nc * 8; d < kd; ++d) {
    const float x = to_f32(k[d]);
    for (int i = 0; i < NH; ++i) s[i] = moejax::fma1(q[i * kd + d], x, s[i]);
  }
  return s;
}

// o[i, d] = sum_j p[j, i] v_j[d] / denom[i] for NH heads (p: kHeadsTogether numerators a
// position): each 8-wide chunk of the head dimension keeps the NH sums in registers over a
// tile of positions (in order), so v_j is widened once for every head.
template <int NH, typename C>
void weigh_values(const float* p, const C* vc, int64_t g_num, int64_t vd, int64_t g,
                  int64_t lo, int64_t hi, v8f denom, float* acc, float* o) {
  const int64_t nc = vd / 8, dv = nc * 8;
  std::fill(acc, acc + NH * vd, 0.0f);
  for (int64_t j0 = lo; j0 <= hi; j0 += kValueTile) {
    const int64_t j1 = std::min(hi + 1, j0 + kValueTile);
    for (int64_t c = 0; c < nc; ++c) {
      v8f a[NH];
      for (int i = 0; i < NH; ++i) a[i] = moejax::load8(acc + i * vd + c * 8);
      const bool line_start = (c * 8 * static_cast<int64_t>(sizeof(C))) % 64 == 0;
      for (int64_t j = j0; j < j1; ++j) {
        if (line_start && j + kAhead < j1)
          __builtin_prefetch(vc + ((j + kAhead) * g_num + g) * vd + c * 8);
        const v8f vv = moejax::load8(vc + (j * g_num + g) * vd + c * 8);
        const float* pj = p + j * kHeadsTogether;
        for (int i = 0; i < NH; ++i) {
          const float e = pj[i];
          a[i] = moejax::fma8(v8f{e, e, e, e, e, e, e, e}, vv, a[i]);
        }
      }
      for (int i = 0; i < NH; ++i) std::memcpy(acc + i * vd + c * 8, &a[i], sizeof(v8f));
    }
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t d = dv; d < vd; ++d) {
        const float x = to_f32(vc[(j * g_num + g) * vd + d]);
        for (int i = 0; i < NH; ++i)
          acc[i * vd + d] =
              moejax::fma1(p[j * kHeadsTogether + i], x, acc[i * vd + d]);
      }
  }
  for (int i = 0; i < NH; ++i)
    for (int64_t d = 0; d < vd; ++d) o[i * vd + d] = acc[i * vd + d] / denom[i];
}

// NH (<= kHeadsTogether) query heads of one KV group g, one row, one token:
// o[i, :] = softmax over the visible positions of (q[i] . k_j) * scale, times v_j.
// A head's numbers depend on NH (a model's group size) alone, not on the row, the token
// or the other heads: its score is group_scores' lane, its softmax its own lane of 8-wide
// steps over the positions in order (the heads are the lanes; one position's row of 8
// holds a group's scores side by side), its value sums weigh_values'.
template <int NH, typename C>
void attend_group(const float* q, const C* kc, const C* vc, int64_t s_len,
                  int64_t g_num, int64_t kd, int64_t vd, int64_t g, int64_t pos, float scale,
                  int64_t window, const float* sinks, float* score, float* acc, float* o) {
  int64_t hi = std::min<int64_t>(pos, s_len - 1), lo = window > 0 ? pos - window + 1 : 0;
  lo = std::max<int64_t>(lo, 0);
  const bool none = hi < lo;   // nothing visible: XLA's masked softmax is uniform over S
  if (none) {
    lo = 0;
    hi = s_len - 1;
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  // score[j * 8 + i]: head i's logit of position j (lanes from NH on unused), then its
  // exp(logit - max)
  v8f mv = v8f{} + ninf;
  const int64_t row_bytes = kd * static_cast<int64_t>(sizeof(C));
  for (int64_t j = lo; j <= hi; ++j) {
    if (j + kAhead <= hi)   // a group's keys are kd of every g_num * kd: help the prefetcher
      for (int64_t b = 0; b < row_bytes; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(kc + ((j + kAhead) * g_num + g) * kd) + b);
    const v8f x = none ? v8f{} : group_scores<NH>(kc + (j * g_num + g) * kd, q, kd) * scale;
    std::memcpy(score + j * kHeadsTogether, &x, sizeof(x));
    mv = x > mv ? x : mv;
  }
  v8f sv = v8f{} + ninf;
  if (sinks)
    for (int i = 0; i < NH; ++i) sv[i] = sinks[i];
  mv = sv > mv ? sv : mv;
  v8f denom = sinks ? exp8(sv - mv) : v8f{};
  for (int64_t j = lo; j <= hi; ++j) {
    float* row = score + j * kHeadsTogether;
    const v8f e = exp8(moejax::load8(row) - mv);
    std::memcpy(row, &e, sizeof(e));
    denom += e;
  }
  weigh_values<NH>(score, vc, g_num, vd, g, lo, hi, denom, acc, o);
}

template <typename C, typename... A>
void attend(int64_t nh, A... a) {
  switch (nh) {
    case 1: attend_group<1, C>(a...); break;
    case 2: attend_group<2, C>(a...); break;
    case 3: attend_group<3, C>(a...); break;
    case 4: attend_group<4, C>(a...); break;
    case 5: attend_group<5, C>(a...); break;
    case 6: attend_group<6, C>(a...); break;
    case 7: attend_group<7, C>(a...); break;
    default: attend_group<8, C>(a...); break;
  }
}

// Rows x tokens x head groups are independent: below this many multiply-adds (about
// 20 us) they run on the calling thread, above it on the pool (a batch's rows, a long
// context's groups).
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
  // one item: up to kHeadsTogether heads of one KV group (row b, token t), in their rows
  // of qf and of
  const int64_t per_g = hq / g_num, chunks = (per_g + kHeadsTogether - 1) / kHeadsTogether;
  std::vector<float> qf(n * qn), of(n * on);
  auto item = [&](int64_t it) {
    thread_local std::vector<float> score, acc;   // this thread's scratch, kept across calls
    score.resize(kHeadsTogether * s_len);
    acc.resize(kHeadsTogether * vdim);
    const int64_t c = it % chunks, g = (it / chunks) % g_num, t = (it / (chunks * g_num)) % t_len;
    const int64_t b = it / (chunks * g_num * t_len);
    const int64_t h0 = g * per_g + c * kHeadsTogether;
    const int64_t nh = std::min<int64_t>(kHeadsTogether, (g + 1) * per_g - h0);
    const int64_t qi = (b * t_len + t) * hq + h0;
    float* qh = qf.data() + qi * kdim;
    if (q_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(q.untyped_data()) + qi * kdim;
      for (int64_t i = 0; i < nh * kdim; ++i) qh[i] = to_f32(src[i]);
    } else {
      std::memcpy(qh, static_cast<const float*>(q.untyped_data()) + qi * kdim,
                  nh * kdim * sizeof(float));
    }
    const float* sk = has_sinks ? sinks.typed_data() + (b * sink_rows / n) * hq + h0 : nullptr;
    const int64_t pos = qpos.typed_data()[b * t_len + t];
    float* o = of.data() + qi * vdim;
    if (c_bf16)
      attend<uint16_t>(nh, qh, static_cast<const uint16_t*>(k.data) + b * kn,
             static_cast<const uint16_t*>(v.data) + b * vn, s_len, g_num, kdim, vdim, g, pos,
             scale, window, sk, score.data(), acc.data(), o);
    else
      attend<float>(nh, qh, static_cast<const float*>(k.data) + b * kn,
             static_cast<const float*>(v.data) + b * vn, s_len, g_num, kdim, vdim, g, pos,
             scale, window, sk, score.data(), acc.data(), o);
    if (q_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(o_->untyped_data()) + qi * vdim;
      for (int64_t i = 0; i < nh * vdim; ++i) dst[i] = to_bf16(o[i]);
    } else {
      std::memcpy(static_cast<float*>(o_->untyped_data()) + qi * vdim, o,
                  nh * vdim * sizeof(float));
    }
  };
  const int64_t items = n * t_len * g_num * chunks;
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
