"""Basic Flax layers with Hugging Face parameter names (``weight`` is [out, in])."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class Linear(nn.Module):
  features: int
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_NxD: jax.Array) -> jax.Array:
    w_OxD = self.param("weight", nn.initializers.normal(0.02),
                       (self.features, x_NxD.shape[-1]), self.dtype)
    y = jnp.einsum("...d,od->...o", x_NxD, w_OxD)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
    return y


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * w, computed in f32 and cast back like HF."""
  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
    return rms_norm(x, w, self.eps)


class SwiGLU(nn.Module):
  """down(silu(gate(x)) * up(x)) with HF names gate_proj / up_proj / down_proj."""
  hidden_size: int
  intermediate_size: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    g = Linear(self.intermediate_size, dtype=self.dtype, name="gate_proj")(x)
    u = Linear(self.intermediate_size, dtype=self.dtype, name="up_proj")(x)
    return Linear(self.hidden_size, dtype=self.dtype, name="down_proj")(jax.nn.silu(g) * u)


def cached_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, positions_BxT, cache, end_index):
  """Causal GQA attention, writing k/v into a static cache at `end_index` when given.

  Returns (o [B, T, H*K], new cache or None).  Scores and softmax in f32; keys at
  cache positions beyond a query's position are masked.
  """
  b, t, hq, hd = q_BxTxHxK.shape
  hk = k_BxTxGxK.shape[2]
  if cache is None:
    keys, values, k_pos = k_BxTxGxK, v_BxTxGxK, positions_BxT
  else:
    at = (0, end_index, 0, 0)
    keys = jax.lax.dynamic_update_slice(cache["k"], k_BxTxGxK.astype(cache["k"].dtype), at)
    values = jax.lax.dynamic_update_slice(cache["v"], v_BxTxGxK.astype(cache["v"].dtype), at)
    cache = {"k": keys, "v": values}
    k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1]), (b, keys.shape[1]))
  q = q_BxTxHxK.reshape(b, t, hk, hq // hk, hd)
  s = jnp.einsum("btkgh,bskh->bkgts", q, keys.astype(q.dtype)).astype(jnp.float32)
  s = s * (hd ** -0.5)
  mask = k_pos[:, None, :] <= positions_BxT[:, :, None]            # [B,T,S]
  s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
  o = jnp.einsum("bkgts,bskh->btkgh", p, values.astype(q.dtype)).reshape(b, t, hq * hd)
  return o, cache


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
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
