"""Qwen3-Next: Gated DeltaNet + gated full attention, zero-centred norms, gated shared expert.

Layer ``i`` mixes tokens with full attention when ``cfg.layer_types[i] ==
"full_attention"`` (every 4th layer on the hub) and with a Gated DeltaNet
otherwise.  Parameter names equal the Hugging Face names
(``layers_0/linear_attn/in_proj_qkvz/weight`` is
``model.layers.0.linear_attn.in_proj_qkvz.weight``), so the generic loader maps
them mechanically.  Routed experts are the plain SwiGLU ``gate_up``/``down``
experts of moejax and use the ``softmax`` router rule (softmax over all
experts, top-k, renormalised when ``norm_topk_prob``).

The DeltaNet cache of a layer is ``{"conv": [B, K-1, C], "state": [B, Hv, Dk, Dv]}``:
the last K-1 conv inputs and the f32 recurrent state.  Unlike a KV cache it
holds *everything* seen so far, so a prefill must not contain padding tokens
(see ``has_recurrent_state``).

Two exact forms of the gated delta rule are provided and pinned equal by a test:
``recurrent_gated_delta_rule`` (a scan over tokens; used for decode) and
``chunked_gated_delta_rule`` (the WY/UT-transform chunked form, a scan over
chunks of 64 tokens; used for prefill).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.model.families.base import Family
from moejax.model.families.configs.qwen3_next import LINEAR, rotary_dim
from moejax.model.layers import (Linear, SwiGLU, cached_attention, linears, partial_rope,
                                 rope_cos_sin)


def has_recurrent_state(cfg) -> bool:
  """True when some layer keeps a recurrent (DeltaNet) state: prefill must be unpadded."""
  return LINEAR in cfg.layer_types


def is_linear_layer(cfg, layer_idx: int) -> bool:
  lt = cfg.layer_types
  return bool(lt) and lt[layer_idx] == LINEAR


# ------------------------------------------------------------------ norms
def zero_centred_rms_norm(x, w, eps: float):
  """x * rsqrt(mean(x^2) + eps) * (1 + w) in f32, cast back (weights stored around 0)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
  """Qwen3-Next's RMSNorm: the weight is initialised at 0 and applied as (1 + w)."""
  eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    w = self.param("weight", nn.initializers.zeros, (x.shape[-1],), self.dtype)
    return zero_centred_rms_norm(x, w, self.eps)


class GatedRMSNorm(nn.Module):
  """The DeltaNet output norm: w * rmsnorm(x) * silu(gate), a plain (not zero-centred) weight."""
  eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, gate):
    w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    y = w * xf.astype(x.dtype)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


# -------------------------------------------------------------- attention
class GatedAttention(nn.Module):
  """Full attention with an output gate: q_proj gives [q | gate] per head; out * sigmoid(gate).

  q and k get a zero-centred RMSNorm over head_dim, then RoPE on the first
  ``partial_rotary_factor * head_dim`` dims only.  Cache: {"k", "v"} as in
  moejax.model.layers.Attention.
  """
  cfg: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, cache, end_index):
    c = self.cfg
    b, t, _ = x_BxTxD.shape
    hq, hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
    lin = lambda n, f: Linear(f, use_bias=c.attention_bias, dtype=self.dtype, name=n)
    qg, k, v = linears(x_BxTxD, [lin("q_proj", hq * hd * 2), lin("k_proj", hk * hd),
                                 lin("v_proj", hk * hd)])
    qg = qg.reshape(b, t, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, hq * hd)
    k, v = k.reshape(b, t, hk, hd), v.reshape(b, t, hk, hd)
    q = ZeroCentredRMSNorm(c.rms_norm_eps, self.dtype, name="q_norm")(q)
    k = ZeroCentredRMSNorm(c.rms_norm_eps, self.dtype, name="k_norm")(k)
    rd = rotary_dim(c)
    cos, sin = rope_cos_sin(positions_BxT, rd, c.rope_theta)
    q, k = partial_rope(q, cos, sin, rd), partial_rope(k, cos, sin, rd)

    o, cache = cached_attention(q, k, v, positions_BxT, cache, end_index)
    o = o * jax.nn.sigmoid(gate)
    return lin("o_proj", c.hidden_size)(o), cache


# ------------------------------------------------------ gated delta rule
def _l2norm(x, eps: float = 1e-6):
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q_BxTxHkxK, k_BxTxHkxK, v_BxTxHxV, g_BxTxH, beta_BxTxH):
  """f32, heads-first [B, H, T, .]; q, k repeated to the value heads, L2-normed, q / sqrt(K)."""
  rep = v_BxTxHxV.shape[2] // k_BxTxHkxK.shape[2]
  q = jnp.repeat(q_BxTxHkxK, rep, axis=2)
  k = jnp.repeat(k_BxTxHkxK, rep, axis=2)
  tr = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 2)
  q, k, v, g, beta = tr(q), tr(k), tr(v_BxTxHxV), tr(g_BxTxH), tr(beta_BxTxH)
  q, k = _l2norm(q), _l2norm(k)
  return q * (q.shape[-1] ** -0.5), k, v, g, beta


@jax.jit
def recurrent_gated_delta_rule(q, k, v, g, beta, state_BxHxKxV):
  """The gated delta rule token by token (the reference form; used for decode).

  q, k: [B, T, Hk, K]; v: [B, T, H, V]; g (log decay), beta: [B, T, H];
  state: [B, H, K, V] f32.  Per token: S <- S * exp(g); S <- S + k (beta (v - S^T k))^T;
  o = S^T q.  Returns (o [B, T, H, V] f32, final state).
  """
  q, k, v, g, beta = _prepare(q, k, v, g, beta)

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t = xs                       # [B,H,K], [B,H,K], [B,H,V], [B,H], [B,H]
    s = s * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
    delta = (v_t - kv_mem) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

  xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
  state, o = jax.lax.scan(step, state_BxHxKxV.astype(jnp.float32), xs)
  return jnp.moveaxis(o, 0, 1), state                  # o: [T,B,H,V] -> [B,T,H,V]


@functools.partial(jax.jit, static_argnames=("chunk",))
def chunked_gated_delta_rule(q, k, v, g, beta, state_BxHxKxV, chunk: int = 64):
  """The same rule in chunks (UT transform inside a chunk, a scan across chunks; for prefill).

  Same arguments and results as `recurrent_gated_delta_rule`.  The sequence is
  zero-padded to a multiple of `chunk` (padded tokens have beta = 0 and g = 0,
  so they neither write nor decay the state).
  """
  q, k, v, g, beta = _prepare(q, k, v, g, beta)
  b, h, t, dk = k.shape
  dv = v.shape[-1]
  c = min(chunk, t)
  pad = (-t) % c
  if pad:
    p4 = ((0, 0), (0, 0), (0, pad), (0, 0))
    q, k, v = jnp.pad(q, p4), jnp.pad(k, p4), jnp.pad(v, p4)
    g, beta = (jnp.pad(a, p4[:3]) for a in (g, beta))
  n = (t + pad) // c
  split = lambda a: a.reshape(b, h, n, c, *a.shape[3:])
  q, k, v, g, beta = (split(a) for a in (q, k, v, g, beta))
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  cum = jnp.cumsum(g, axis=-1)                                     # [B,H,N,C]
  lower = jnp.tril(jnp.ones((c, c), bool))
  decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
  # (I + tril(diag(beta) K K^T * decay, -1)) is unit lower triangular: solve instead of invert.
  ut = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * decay
  ut = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), ut, 0.0) + jnp.eye(c, dtype=ut.dtype)
  solve = lambda rhs: jax.scipy.linalg.solve_triangular(ut, rhs, lower=True, unit_diagonal=True)
  new_v = solve(v_beta)                                            # [B,H,N,C,V]
  k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])             # [B,H,N,C,K]
  intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay           # causal, incl. diagonal
  q_dec = q * jnp.exp(cum)[..., None]
  k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])                              # [B,H,N]

  def step(s, xs):
    q_i, k_i, nv_i, kc_i, in_i, d_i = xs
    v_new = nv_i - jnp.einsum("bhck,bhkv->bhcv", kc_i, s)
    o = jnp.einsum("bhck,bhkv->bhcv", q_i, s) + jnp.einsum("bhij,bhjv->bhiv", in_i, v_new)
    s = s * d_i[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_i, v_new)
    return s, o

  xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q_dec, k_dec, new_v, k_cumdecay, intra, chunk_decay))
  state, o = jax.lax.scan(step, state_BxHxKxV.astype(jnp.float32), xs)  # o: [N,B,H,C,V]
  o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
  return jnp.moveaxis(o, 1, 2), state


def init_linear_cache(cfg, batch: int, dtype=jnp.float32) -> dict:
  """A DeltaNet layer's cache: last K-1 conv inputs and the f32 recurrent state."""
  fc = cfg.family_config
  conv_dim = 2 * fc.linear_num_key_heads * fc.linear_key_head_dim + (
      fc.linear_num_value_heads * fc.linear_value_head_dim)
  return {"conv": jnp.zeros((batch, fc.linear_conv_kernel_dim - 1, conv_dim), dtype),
          "state": jnp.zeros((batch, fc.linear_num_value_heads, fc.linear_key_head_dim,
                              fc.linear_value_head_dim), jnp.float32)}


class _Weight(nn.Module):
  """A bare ``weight`` parameter (HF's conv1d.weight [C, 1, K])."""
  shape: tuple
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self):
    return self.param("weight", nn.initializers.normal(0.1), self.shape, self.dtype)


class GatedDeltaNet(nn.Module):
  """Qwen3-Next's linear-attention mixer (same call signature as attention; positions unused).

  in_proj_qkvz is grouped per key head as [q (K), k (K), v (r*V), z (r*V)] with
  r = value heads / key heads; in_proj_ba per key head as [b (r), a (r)].  A
  depthwise causal conv (kernel K, SiLU) runs over [q | k | v]; beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias); the output goes through the gated
  RMSNorm with z, then out_proj.
  """
  cfg: Any
  dtype: Any = jnp.float32
  chunk: int = 64

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, cache, end_index):
    del positions_BxT, end_index  # the state is the whole past
    c, fc = self.cfg, self.cfg.family_config
    bsz, t, _ = x_BxTxD.shape
    nk, nv = fc.linear_num_key_heads, fc.linear_num_value_heads
    dk, dv, ks = fc.linear_key_head_dim, fc.linear_value_head_dim, fc.linear_conv_kernel_dim
    r = nv // nk
    conv_dim = 2 * nk * dk + nv * dv
    qkvz, ba = linears(x_BxTxD, [
        Linear(2 * nk * dk + 2 * nv * dv, dtype=self.dtype, name="in_proj_qkvz"),
        Linear(2 * nv, dtype=self.dtype, name="in_proj_ba")])
    qkvz = qkvz.reshape(bsz, t, nk, 2 * dk + 2 * r * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
    v = qkvz[..., 2 * dk:2 * dk + r * dv]
    z = qkvz[..., 2 * dk + r * dv:].reshape(bsz, t, nv, dv)
    ba = ba.reshape(bsz, t, nk, 2 * r)
    b_, a_ = ba[..., :r].reshape(bsz, t, nv), ba[..., r:].reshape(bsz, t, nv)
    mixed = jnp.concatenate([q.reshape(bsz, t, nk * dk), k.reshape(bsz, t, nk * dk),
                             v.reshape(bsz, t, nv * dv)], axis=-1)          # [B,T,C]

    # depthwise causal conv over [past K-1 inputs | new inputs]
    w_CxK = _Weight((conv_dim, 1, ks), self.dtype, name="conv1d")()[:, 0, :]
    past = (jnp.zeros((bsz, ks - 1, conv_dim), mixed.dtype) if cache is None
            else cache["conv"].astype(mixed.dtype))
    xs = jnp.concatenate([past, mixed], axis=1)                             # [B,K-1+T,C]
    conv = sum(xs[:, j:j + t, :] * w_CxK[:, j] for j in range(ks))
    mixed = jax.nn.silu(conv)
    q = mixed[..., :nk * dk].reshape(bsz, t, nk, dk)
    k = mixed[..., nk * dk:2 * nk * dk].reshape(bsz, t, nk, dk)
    v = mixed[..., 2 * nk * dk:].reshape(bsz, t, nv, dv)

    dt_bias = self.param("dt_bias", nn.initializers.ones, (nv,), self.dtype)
    a_log = self.param("A_log", nn.initializers.zeros, (nv,), self.dtype)
    beta = jax.nn.sigmoid(b_.astype(jnp.float32))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a_.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    state = (jnp.zeros((bsz, nv, dk, dv), jnp.float32) if cache is None else cache["state"])
    rule = recurrent_gated_delta_rule if t == 1 else (
        lambda *a: chunked_gated_delta_rule(*a, chunk=self.chunk))
    o, state = rule(q, k, v, g, beta, state)
    o = GatedRMSNorm(c.rms_norm_eps, self.dtype, name="norm")(o.astype(x_BxTxD.dtype), z)
    out = Linear(c.hidden_size, dtype=self.dtype, name="out_proj")(o.reshape(bsz, t, nv * dv))
    if cache is not None:
      cache = {"conv": xs[:, -(ks - 1):].astype(cache["conv"].dtype), "state": state}
    return out, cache


# ------------------------------------------------------------------- MoE
class SparseMoeBlock(nn.Module):
  """The dense half of a Qwen3-Next MoE block: the router and the sigmoid-gated shared expert.

  Calling it gives the router logits (``mlp.gate.weight``); the routed experts
  live outside the params.  ``shared_output`` is sigmoid(shared_expert_gate(x)) *
  shared_expert(x), added to the routed sum by DecoderLayer.moe_residual.
  """
  cfg: Any
  dtype: Any = jnp.float32

  def setup(self):
    c = self.cfg
    self.gate = Linear(c.num_experts, dtype=self.dtype)
    self.shared_expert = SwiGLU(c.hidden_size, c.family_config.shared_expert_intermediate_size,
                                self.dtype)
    self.shared_expert_gate = Linear(1, dtype=self.dtype)

  def __call__(self, x):
    return self.gate(x)

  def shared_output(self, x):
    return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3Next(Family):
  """Gated DeltaNet / gated attention layers, zero-centred norms, gated shared expert."""
  model_types = ("qwen3_next",)

  def norm(self, cfg, dtype):
    return ZeroCentredRMSNorm(cfg.rms_norm_eps, dtype)

  def mixer(self, cfg, layer_idx, dtype):
    if is_linear_layer(cfg, layer_idx):
      return GatedDeltaNet(cfg, dtype)
    return GatedAttention(cfg, dtype)

  def mixer_name(self, cfg, layer_idx):
    return "linear_attn" if is_linear_layer(cfg, layer_idx) else "self_attn"

  def sparse_mlp(self, cfg, dtype):
    return SparseMoeBlock(cfg, dtype)

  def init_cache(self, cfg, batch, max_len, dtype=jnp.float32):
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return [init_linear_cache(cfg, batch, dtype) if is_linear_layer(cfg, i)
            else {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for i in range(cfg.num_layers)]

  def has_recurrent_state(self, cfg):
    return has_recurrent_state(cfg)


FAMILY = Qwen3Next()
