"""GPT-OSS (model_type ``gpt_oss``): attention, router, experts and tensor names (the config
rules and `GptOssConfig`: ``configs/gpt_oss.py``).

What differs from the Qwen3-MoE layout (checked against transformers 5.24
``modeling_gpt_oss.py``):
  * attention: q/k/v/o biases; a learned per-head *sink* logit joins the softmax
    and is then dropped; layers marked ``sliding_attention`` see only keys with
    position > q - sliding_window; YaRN RoPE (cos/sin scaled by the attention
    factor 0.1 ln(factor) + 1).
  * router ``mlp.router.{weight,bias}``: top-k of the raw logits, softmax over the
    k values (`moejax.model.routing`, rule ``topk_softmax``).
  * experts: gate and up are *interleaved* rows of one projection with biases;
    out = down((clamp(up, -L, L) + 1) * g * sigmoid(alpha g)) + b, g = min(gate, L).

Routed experts arrive as a dict with a leading expert (or slot) axis, in moejax's
[out, in] orientation:
  dequantised: gate_up [E, 2I, D] (rows interleaved gate, up, gate, ...),
               gate_up_bias [E, 2I], down [E, D, I], down_bias [E, D];
  MXFP4:       gate_up_blocks [E, 2I, D/32, 16] u8, gate_up_scales [E, 2I, D/32] u8,
               down_blocks [E, D, I/32, 16] u8, down_scales [E, D, I/32] u8, + the biases.
The MXFP4 dict is what the hub stores (before transformers' transpose), so an
offloaded fetch moves the 4-bit bytes and `expert_ffn` dequantises on the device.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.families import mxfp4
from moejax.model.families.base import Family, RouterRule
from moejax.model.families.configs.gpt_oss import MODEL_TYPE, ROUTER, expert_shapes
from moejax.model.layers import Linear, apply_rope, rope_attention

MXFP4_KEYS = ("gate_up_blocks", "gate_up_scales", "gate_up_bias",
              "down_blocks", "down_scales", "down_bias")


# ------------------------------------------------------------------ router rule
def route_topk_softmax(cfg, logits_NxE):
  """Top-k of the raw logits (the router has a bias), softmax over those k values; scores =
  softmax over all experts (the logits' order, bounded in [0, 1])."""
  top_l, ids = jax.lax.top_k(logits_NxE, cfg.top_k)
  return (ids.astype(jnp.int32), jax.nn.softmax(top_l, axis=-1),
          jax.nn.softmax(logits_NxE, axis=-1))


def rank_logits(cfg, logits_NxE):
  del cfg
  return logits_NxE


# ------------------------------------------------------------------------- rope
def rope_inv_freq(cfg) -> tuple[np.ndarray, float]:
  """(inv_freq [head_dim/2] f32, attention factor): YaRN as transformers computes it."""
  p = dict(cfg.rope_scaling)
  dim, base = cfg.head_dim, cfg.rope_theta
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  if p.get("rope_type", "default") != "yarn":
    return (1.0 / pos_freqs).astype(np.float32), 1.0
  factor = float(p["factor"])
  orig = float(p["original_max_position_embeddings"])
  attn = p.get("attention_factor")
  if attn is None:
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    get = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    attn = get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
  beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
  corr = lambda rot: (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))
  low, high = corr(beta_fast), corr(beta_slow)
  if p.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrap = (1 - ramp).astype(np.float32)
  inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
  return inv.astype(np.float32), float(attn)


def rope_cos_sin(cfg, positions_BxT):
  """cos/sin tables [B, T, head_dim] (frequencies repeated twice), scaled by the factor."""
  inv, attn = rope_inv_freq(cfg)
  freqs = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb) * attn, jnp.sin(emb) * attn


# -------------------------------------------------------------------- attention
class Attention(nn.Module):
  """GQA with biases, attention sinks, optional sliding window and YaRN RoPE."""
  cfg: Any
  sliding: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, cache, end_index):
    c = self.cfg
    cos, sin = rope_cos_sin(c, positions_BxT)
    sinks_H = self.param("sinks", nn.initializers.normal(0.02), (c.num_heads,), self.dtype)
    return rope_attention(c, x_BxTxD, positions_BxT, cache, end_index, self.dtype,
                          lambda a: apply_rope(a, cos, sin), o_bias=c.attention_bias,
                          window=c.family_config.sliding_window if self.sliding else None,
                          sinks_H=sinks_H)


class Router(nn.Module):
  """``mlp.router``: linear with bias over the experts (logits; see routing.route)."""
  cfg: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    return Linear(self.cfg.num_experts, use_bias=True, dtype=self.dtype, name="router")(x)


# ---------------------------------------------------------------------- experts
def is_expert_dict(w: dict) -> bool:
  """True for a gpt_oss expert dict (dequantised or MXFP4)."""
  return "gate_up_bias" in w


def num_experts(w: dict) -> int:
  return w["gate_up_bias"].shape[0]


def _weight(w: dict, name: str, dtype):
  if name in w:
    return w[name].astype(dtype)
  return mxfp4.dequantize(w[name + "_blocks"], w[name + "_scales"], dtype)


def expert_ffn(x_NxBxD, w: dict, alpha: float, limit: float):
  """Clamped SwiGLU with biases; `w` holds one expert per leading index n (gathered).

  x [N, B, D] rows are computed by expert n; returns [N, B, D].  MXFP4 weights
  are dequantised here, on the device, into x's dtype.
  """
  dt = x_NxBxD.dtype
  h = jnp.einsum("nbd,nid->nbi", x_NxBxD, _weight(w, "gate_up", dt))
  h = h + w["gate_up_bias"].astype(dt)[:, None, :]
  gate, up = h[..., 0::2], h[..., 1::2]
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  a = (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
  y = jnp.einsum("nbi,ndi->nbd", a, _weight(w, "down", dt))
  return y + w["down_bias"].astype(dt)[:, None, :]


def quantize_experts(w: dict) -> dict:
  """A dequantised expert dict (numpy, leading expert axis) -> the MXFP4 dict."""
  gb, gs = mxfp4.quantize(np.asarray(w["gate_up"], np.float32))
  db, ds = mxfp4.quantize(np.asarray(w["down"], np.float32))
  return {"gate_up_blocks": gb, "gate_up_scales": gs, "gate_up_bias": np.asarray(w["gate_up_bias"]),
          "down_blocks": db, "down_scales": ds, "down_bias": np.asarray(w["down_bias"])}


# ----------------------------------------------------------------------- loader
HF_NAMES = {  # our expert key -> hub tensor suffix under model.layers.{i}.mlp.experts.
    "gate_up": "gate_up_proj", "gate_up_bias": "gate_up_proj_bias",
    "down": "down_proj", "down_bias": "down_proj_bias",
    "gate_up_blocks": "gate_up_proj_blocks", "gate_up_scales": "gate_up_proj_scales",
    "down_blocks": "down_proj_blocks", "down_scales": "down_proj_scales",
}


def load_layer_experts(idx, names: dict[str, str], cfg, layer: int, np_dtype, *,
                       dequantize_mxfp4: bool, mmap: bool, check_finite: bool,
                       check: Callable, error: type, model_dir: str) -> dict[str, np.ndarray]:
  """One layer's routed experts from the hub tensors `names` (suffix -> tensor name).

  Accepts the MXFP4 hub layout (``*_blocks``/``*_scales``) and the float layout
  transformers writes (``gate_up_proj`` [E, D, 2I], ``down_proj`` [E, I, D]).
  Returns the expert dict described in the module docstring.
  """
  e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  quant = "gate_up_proj_blocks" in names or "down_proj_blocks" in names
  need = (("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
          if quant else ("gate_up_proj", "down_proj")) + ("gate_up_proj_bias", "down_proj_bias")
  for n in need:
    if n not in names:
      raise error(f"{model_dir}: missing tensor 'model.layers.{layer}.mlp.experts.{n}'")

  def get_float(n, shape):
    a = idx.get(names[n])
    check(idx, names[n], a, shape, check_finite)
    return a

  out = {"gate_up_bias": np.array(get_float("gate_up_proj_bias", (e, 2 * i)), dtype=np_dtype),
         "down_bias": np.array(get_float("down_proj_bias", (e, d)), dtype=np_dtype)}
  if not quant:
    gu = get_float("gate_up_proj", (e, d, 2 * i))
    dn = get_float("down_proj", (e, i, d))
    out["gate_up"] = np.ascontiguousarray(np.swapaxes(gu, 1, 2), dtype=np_dtype)
    out["down"] = np.ascontiguousarray(np.swapaxes(dn, 1, 2), dtype=np_dtype)
    return out
  if d % mxfp4.BLOCK or i % mxfp4.BLOCK:
    raise error(f"{model_dir}: MXFP4 experts need hidden_size ({d}) and intermediate_size "
                f"({i}) to be multiples of {mxfp4.BLOCK}")
  shapes = expert_shapes(cfg, "mxfp4")
  q = {}
  for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"):
    n = names[HF_NAMES[key]]
    a = idx.get(n)
    if idx.dtype(n) != "U8":
      raise error(f"{idx.where[n]}: tensor '{n}' has dtype {idx.dtype(n)}, expected U8 (MXFP4)")
    if tuple(a.shape) != (e,) + shapes[key]:
      raise error(f"{idx.where[n]}: tensor '{n}' has shape {tuple(a.shape)}, expected "
                  f"{(e,) + shapes[key]}")
    q[key] = a
  if dequantize_mxfp4:
    out["gate_up"] = mxfp4.dequantize_np(q["gate_up_blocks"], q["gate_up_scales"], np_dtype)
    out["down"] = mxfp4.dequantize_np(q["down_blocks"], q["down_scales"], np_dtype)
    return out
  out.update({k: (v if mmap else np.array(v)) for k, v in q.items()})
  return out


def expert_forward_np(x_D: np.ndarray, w: dict, alpha: float = 1.702,
                      limit: float = 7.0) -> np.ndarray:
  """One expert on the host in f32 numpy (the `host` miss policy); MXFP4 dequantised here.

  alpha and limit default to the constants of every published GPT-OSS checkpoint.
  """
  def weight(name):
    if name in w:
      return np.asarray(w[name], np.float32)
    return mxfp4.dequantize_np(w[name + "_blocks"], w[name + "_scales"])
  h = weight("gate_up") @ x_D.astype(np.float32) + np.asarray(w["gate_up_bias"], np.float32)
  gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
  a = (up + 1) * gate / (1 + np.exp(-alpha * gate))
  return weight("down") @ a + np.asarray(w["down_bias"], np.float32)


class GptOss(Family):
  """Attention sinks, biases, YaRN, sliding layers; clamped-SwiGLU experts (float or MXFP4)."""
  model_types = (MODEL_TYPE,)
  router_rules = {ROUTER: RouterRule(route=route_topk_softmax,
                                     rank_scores=rank_logits)}
  expert_ffn = staticmethod(expert_ffn)
  expert_forward_np = staticmethod(expert_forward_np)
  load_layer_experts = staticmethod(load_layer_experts)

  def mixer(self, cfg, layer_idx, dtype):
    return Attention(cfg, cfg.layer_types[layer_idx] == "sliding_attention", dtype)

  def sparse_mlp(self, cfg, dtype):
    return Router(cfg, dtype)                 # mlp.router.{weight,bias}

  def swiglu(self, cfg):
    return cfg.family_config.swiglu_alpha, cfg.family_config.swiglu_limit

  def is_expert_dict(self, w):
    return is_expert_dict(w)


FAMILY = GptOss()
