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


def swiglu_mlp(x: jax.Array, w_gate_up_2IxD: jax.Array, w_down_DxI: jax.Array) -> jax.Array:
  """down(silu(gate(x)) * up(x)) with gate and up stacked as [2I, D]."""
  h = jnp.einsum("...d,id->...i", x, w_gate_up_2IxD)
  g, u = jnp.split(h, 2, axis=-1)
  return jnp.einsum("...i,di->...d", jax.nn.silu(g) * u, w_down_DxI)
