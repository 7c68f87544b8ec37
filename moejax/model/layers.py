"""Basic Flax layers with Hugging Face parameter names (``weight`` is [out, in])."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.kernels import cpu_attention
from moejax.kernels import cpu_matmul
from moejax.kernels import cpu_rows
from moejax.kernels import layer_view
from moejax.model import quant_ops


class Linear(nn.Module):
  features: int
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_NxD: jax.Array, *, params_only: bool = False):
    """x @ weight.T (+ bias); with `params_only`, (weight, bias or None) for `linears`."""
    w_OxD = held(self, "weight") or self.param(
        "weight", nn.initializers.normal(0.02), (self.features, x_NxD.shape[-1]), self.dtype)
    b_O = (self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
           if self.use_bias else None)
    if params_only:
      return w_OxD, b_O
    return _project(x_NxD, [(w_OxD, b_O)])[0]


def held(module, name: str):
  """A parameter held as ggml blocks (a QuantArray: --weights, a GGUF file), else None.
  Flax's `param` checks a given value's shape against its initializer's, which a
  QuantArray's blocks never match; such a weight is read as the variable it is."""
  if module.has_variable("params", name):
    v = module.get_variable("params", name)
    if quant_ops.is_quant(v):
      return v
  return None


class Embed(nn.Module):
  """`nn.Embed` (param ``embedding`` [V, D]) whose table may be a QuantArray."""
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = held(self, "embedding") or self.param(
        "embedding", nn.initializers.normal(0.02), (self.num_embeddings, self.features),
        self.dtype)

  def __call__(self, tokens):
    if quant_ops.is_quant(self.embedding):
      return quant_ops.embed(self.embedding, tokens, self.dtype)
    return jnp.take(jnp.asarray(self.embedding, self.dtype), tokens, axis=0)

  def attend(self, x):
    """x @ embedding.T (a tied LM head)."""
    if not quant_ops.is_quant(self.embedding):
      return jnp.dot(x.astype(self.dtype), jnp.asarray(self.embedding, self.dtype).T)
    lead = x.shape[:-1]
    y = quant_ops.linears(x.reshape(-1, x.shape[-1]).astype(self.dtype), [self.embedding])[0]
    return y.reshape(*lead, -1)


def _project(x_NxD, wbs):
  lead = x_NxD.shape[:-1]
  ys = quant_ops.linears(x_NxD.reshape(-1, x_NxD.shape[-1]), [w for w, _ in wbs])
  return [y.reshape(*lead, -1) if b is None else y.reshape(*lead, -1) + b
          for y, (_, b) in zip(ys, wbs)]


def linears(x_NxD: jax.Array, mods) -> list:
  """[m(x) for m in mods] for Linear modules of the same input, as one kernel call on
  CPU for a few rows (a decode step's q/k/v, a SwiGLU's gate/up): one dispatch instead
  of one per projection (cpu_matmul.linears)."""
  return _project(x_NxD, [m(x_NxD, params_only=True) for m in mods])


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * w, computed in f32 and cast back like HF."""
  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
    return rms_norm(x, w, self.eps)


def project_qkv(c, x_BxTxD: jax.Array, dtype):
  """q [B,T,Hq,hd], k and v [B,T,Hk,hd] of a GQA layer, with HF names q_proj / k_proj /
  v_proj (biases per ``c.attention_bias``) and the config's optional qk clipping and
  q/k RMSNorm (``c.qk_norm``: "full" over the projection, "head" per head).

  Call it inside an ``@nn.compact`` method: the submodules belong to the caller.
  """
  b, t, _ = x_BxTxD.shape
  hq, hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
  lin = lambda n, f: Linear(f, use_bias=c.attention_bias, dtype=dtype, name=n)
  q, k, v = linears(x_BxTxD, [lin("q_proj", hq * hd), lin("k_proj", hk * hd),
                               lin("v_proj", hk * hd)])
  if c.qk_norm == "full":
    q = RMSNorm(c.rms_norm_eps, dtype, name="q_norm")(q)
    k = RMSNorm(c.rms_norm_eps, dtype, name="k_norm")(k)
  if c.clip_qkv is not None:
    q, k, v = (jnp.clip(a, -c.clip_qkv, c.clip_qkv) for a in (q, k, v))
  q, k, v = q.reshape(b, t, hq, hd), k.reshape(b, t, hk, hd), v.reshape(b, t, hk, hd)
  if c.qk_norm == "head":
    q = RMSNorm(c.rms_norm_eps, dtype, name="q_norm")(q)
    k = RMSNorm(c.rms_norm_eps, dtype, name="k_norm")(k)
  return q, k, v


class SwiGLU(nn.Module):
  """down(silu(gate(x)) * up(x)) with HF names gate_proj / up_proj / down_proj."""
  hidden_size: int
  intermediate_size: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    g, u = linears(x, [Linear(self.intermediate_size, dtype=self.dtype, name=n)
                       for n in ("gate_proj", "up_proj")])
    return Linear(self.hidden_size, dtype=self.dtype, name="down_proj")(jax.nn.silu(g) * u)


def write_cache(cache_arr, new, end_index):
  """Writes `new` [B, T, ...] into the static cache [B, S, ...] at position end_index: one
  for the batch, or [B] (row b at end_index[b]: sequences decoded together, each at its
  own position)."""
  if jnp.ndim(end_index) == 1 and (layer_view.of(cache_arr) is not None
                                   or jnp.dtype(cache_arr.dtype).itemsize == 2):
    # a layer of the scanned engine's stacked cache, or a 16-bit one (`_write`'s kernel):
    # one in-place update per row (a vmap of the update copied the whole stack at every
    # layer: 3.5x a batch-8 step at 2,048 positions on the demo model)
    for b in range(new.shape[0]):
      cache_arr = _write(cache_arr, new[b:b + 1], (b, end_index[b]) + (0,) * (new.ndim - 2))
    return cache_arr
  if jnp.ndim(end_index) == 1:
    return jax.vmap(lambda c, n, e: write_cache(c[None], n[None], e)[0])(cache_arr, new,
                                                                         end_index)
  return _write(cache_arr, new, (0, end_index) + (0,) * (new.ndim - 2))


def _write(cache_arr, new, idx):
  """`new` written at idx (`layer_view.update`: a layer of the stacked cache in place
  there; 16-bit floats in place by a kernel on the CPU, where XLA's update of a bf16 cache
  was a loop over the whole cache at every step: wide_bf16's Sampler at max_len 256, 0.39
  ms a token)."""
  return layer_view.update(cache_arr, new, idx)


def cache_positions(keys_BxSx_, batch: int):
  return jnp.broadcast_to(jnp.arange(keys_BxSx_.shape[1]), (batch, keys_BxSx_.shape[1]))


def read_cache(cache, new: dict, positions_BxT, end_index):
  """What attention reads: without a cache, the new keys (and values) `new` {name: [B, T,
  ...]} at their positions; else each written into the cache's array of that name at
  end_index -> (arrays by name, their positions [B, S], the new cache or None)."""
  if cache is None:
    return new, positions_BxT, None
  cache = {n: write_cache(cache[n], a, end_index) for n, a in new.items()}
  return cache, cache_positions(next(iter(cache.values())), positions_BxT.shape[0]), cache


def gqa_attention(q_BxTxHxK, k_BxSxGxK, v_BxSxGxV, q_pos_BxT, k_pos_BxS, scale: float,
                  window: int | None = None, sinks_H=None):
  """Causal softmax attention, f32 scores, query heads grouped over key heads.

  `window`: keys with k_pos > q_pos - window only (sliding window).  `sinks_H`: a
  learned logit per query head joins the softmax and is then dropped (GPT-OSS).
  Returns [B, T, H*V].
  """
  b, t, hq, kd = q_BxTxHxK.shape
  hk = k_BxSxGxK.shape[2]
  g = hq // hk
  q = q_BxTxHxK.reshape(b, t, hk, g, kd)
  s = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxGxK.astype(q.dtype)).astype(jnp.float32) * scale
  mask = k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None]            # [B,T,S]
  if window is not None:
    mask &= k_pos_BxS[:, None, :] > q_pos_BxT[:, :, None] - window
  s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
  if sinks_H is None:
    p = jax.nn.softmax(s, axis=-1)
  else:
    sink = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, hk, g, 1, 1), (b, hk, g, t, 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
  o = jnp.einsum("bkgts,bskh->btkgh", p.astype(q.dtype), v_BxSxGxV.astype(q.dtype))
  return o.reshape(b, t, hq * v_BxSxGxV.shape[-1])


def cached_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, positions_BxT, cache, end_index,
                     scale: float | None = None, window: int | None = None, sinks_H=None):
  """`gqa_attention` over the new keys, or over a static cache they are written into.

  Returns (o [B, T, H*K], new cache or None).  Keys at cache positions beyond a
  query's position are masked.
  """
  scale = q_BxTxHxK.shape[-1] ** -0.5 if scale is None else scale
  kv, k_pos, cache = read_cache(cache, {"k": k_BxTxGxK, "v": v_BxTxGxK}, positions_BxT,
                                end_index)
  keys, values = kv["k"], kv["v"]
  t = q_BxTxHxK.shape[1]
  if (cache is not None and isinstance(end_index, int) and end_index == 0 and t > 1
      and all(isinstance(a, jax.Array) for a in (keys, values))):
    # a prompt from position 0: the cache holds nothing before it, so its first t
    # positions (the keys as the cache stores them) are all a query can see; a softmax
    # over the whole max_len would mask the rest at a cost that grows with max_len
    keys, values, k_pos = keys[:, :t], values[:, :t], k_pos[:, :t]
  elif cache is not None:
    if cpu_attention.supports(q_BxTxHxK, keys, values):   # decode on CPU: the kernel
      o = cpu_attention.decode_attention(
          q_BxTxHxK, keys, values, positions_BxT, scale, window, sinks_H,
          lambda: gqa_attention(q_BxTxHxK, keys, values, positions_BxT, k_pos, scale, window,
                                sinks_H))
      return o, cache
  o = gqa_attention(q_BxTxHxK, keys, values, positions_BxT, k_pos, scale, window, sinks_H)
  return o, cache


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * w over the last axis (HF's RMSNorm): one kernel call
  on CPU (cpu_rows), `xla_rms_norm` elsewhere."""
  return cpu_rows.rms_norm(x, w, eps, xla_rms_norm)


def xla_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w * xf.astype(x.dtype)


def rope_cos_sin(positions_BxT: jax.Array, head_dim: int, theta: float):
  """Default RoPE tables [B, T, head_dim] (HF layout: frequencies repeated twice)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BxTxHxK: jax.Array, cos_BxTxK: jax.Array, sin_BxTxK: jax.Array) -> jax.Array:
  half = x_BxTxHxK.shape[-1] // 2
  x1, x2 = x_BxTxHxK[..., :half], x_BxTxHxK[..., half:]
  rot = jnp.concatenate([-x2, x1], axis=-1)
  cos, sin = cos_BxTxK[:, :, None, :], sin_BxTxK[:, :, None, :]
  return (x_BxTxHxK * cos + rot * sin).astype(x_BxTxHxK.dtype)


class Attention(nn.Module):
  """GQA with RoPE on the first ``partial_rotary_factor * head_dim`` dims (the whole head
  unless the config says less: glm4_moe's half), qk norm / clipping per the config; an
  o_proj bias per ``o_bias`` (None: ``c.attention_bias``); {"k", "v"} cache."""
  cfg: Any
  dtype: Any = jnp.float32
  o_bias: bool | None = None

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, cache, end_index):
    c = self.cfg
    rd = int(c.head_dim * c.partial_rotary_factor)
    cos, sin = rope_cos_sin(positions_BxT, rd, c.rope_theta)
    return rope_attention(c, x_BxTxD, positions_BxT, cache, end_index, self.dtype,
                          lambda a: partial_rope(a, cos, sin, rd),
                          o_bias=c.attention_bias if self.o_bias is None else self.o_bias)


def partial_rope(x_BxTxHxK: jax.Array, cos_BxTxR, sin_BxTxR, rd: int) -> jax.Array:
  """`apply_rope` on the first `rd` dims of each head; the rest pass through."""
  if rd == x_BxTxHxK.shape[-1]:
    return apply_rope(x_BxTxHxK, cos_BxTxR, sin_BxTxR)
  return jnp.concatenate([apply_rope(x_BxTxHxK[..., :rd], cos_BxTxR, sin_BxTxR),
                          x_BxTxHxK[..., rd:]], axis=-1)


def rope_attention(c, x_BxTxD, positions_BxT, cache, end_index, dtype, rope, o_bias: bool,
                   **attend):
  """The GQA attention block of every family: q/k/v (`project_qkv`), `rope` applied to
  q and k, `cached_attention` (`attend`: its window, sinks_H), then ``o_proj`` (with a
  bias when `o_bias`) -> (out, new cache).

  Call it inside an ``@nn.compact`` method: the submodules belong to the caller.
  """
  q, k, v = project_qkv(c, x_BxTxD, dtype)
  o, cache = cached_attention(rope(q), rope(k), v, positions_BxT, cache, end_index, **attend)
  return Linear(c.hidden_size, use_bias=o_bias, dtype=dtype, name="o_proj")(o), cache


class Router(nn.Module):
  """``mlp.gate``: the router logits of a sparse layer."""
  cfg: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    return Linear(self.cfg.num_experts, dtype=self.dtype, name="gate")(x)
