"""GLM-4.5 (glm4_moe), GLM-4.7-Flash (glm4_moe_lite) and DeepSeek-V3 (deepseek_v3).

What these families share:
  * the sigmoid router with ``e_score_correction_bias`` and group-limited top-k
    (the rule itself lives in ``moejax.model.routing``, kind ``"sigmoid_group"``);
  * ungated shared experts added to the routed output;
  * the first layers dense (``first_k_dense_replace``, or ``mlp_layer_types``).
glm4_moe uses grouped-query attention (`layers.Attention`) with partial rotary embeddings
(``rotate_half`` on the first ``partial_rotary_factor * head_dim`` dims) and
biases on q/k/v only; glm4_moe_lite and deepseek_v3 use multi-head latent
attention (MLA), whose KV cache holds the compressed latent (kv_lora_rank) and
the shared rotary key (qk_rope_head_dim) rather than per-head keys and values.

Parameter names equal the Hugging Face names so the loader maps them
mechanically (``layers_1/mlp/gate/e_score_correction_bias`` is
``model.layers.1.mlp.gate.e_score_correction_bias``).

Router output: the layer's router returns ``[..., 2E]``: the raw logits, then
the layer's correction bias broadcast over tokens.  Carrying the bias with the
logits keeps ``routing.route(cfg, router_logits)`` the complete rule (the
offload policy, the emulator and the simulator replaying recorded logits need
nothing else).

The config rules and `GlmConfig` (``cfg.family_config``) are in ``configs/glm.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.model.families.base import Family, RouterRule
from moejax.model.families.configs.glm import MLA_TYPES, MODEL_TYPES
from moejax.model.layers import (Attention, Linear, RMSNorm, SwiGLU, apply_rope,
                                 gqa_attention, read_cache, rope_cos_sin)


# ------------------------------------------------------------------ router rule
def _split_bias(cfg: Any, logits):
  """A sigmoid_group router output [..., 2E] -> (logits, correction bias)."""
  e = cfg.num_experts
  if logits.shape[-1] == 2 * e:
    return logits[..., :e], logits[..., e:]
  if logits.shape[-1] == e:
    return logits, jnp.zeros_like(logits)
  raise ValueError(f"router output has {logits.shape[-1]} columns; a sigmoid_group router "
                   f"of {e} experts gives {2 * e} (logits, correction bias) or {e}")


def route_sigmoid_group(cfg: Any, logits):
  """DeepSeek-V3 / GLM-4.5 routing (``cfg.router == "sigmoid_group"``).

  The router output is ``[..., 2E]``: raw logits, then the layer's
  ``e_score_correction_bias`` (a plain ``[..., E]`` means a zero bias).  Scores
  are sigmoid(logits) + bias; the best ``topk_group`` of ``n_group`` groups
  (ranked by the sum of their two best scores) are kept and the top-k taken
  among them.  Gates are the *unbiased* sigmoids of the selected experts,
  divided by their sum (+1e-20) if ``norm_topk_prob``, times
  ``routed_scaling_factor``: they need not sum to 1.  The returned scores are
  the biased scores over all experts (before the group mask); `rank_scores`
  gives the same for ranking substitutes.
  """
  fc = cfg.family_config
  e, g = cfg.num_experts, fc.n_group
  logits, bias = _split_bias(cfg, logits)
  sig = jax.nn.sigmoid(logits)
  scores = sig + bias
  choice = scores
  if g > 1:
    per = scores.reshape(scores.shape[:-1] + (g, e // g))
    group_scores = jnp.sum(jax.lax.top_k(per, 2)[0], axis=-1)                 # [..., G]
    _, keep = jax.lax.top_k(group_scores, fc.topk_group)
    group_mask = jnp.any(jax.nn.one_hot(keep, g, dtype=jnp.bool_), axis=-2)    # [..., G]
    choice = jnp.where(jnp.repeat(group_mask, e // g, axis=-1), scores, -jnp.inf)
  _, ids = jax.lax.top_k(choice, cfg.top_k)
  w = jnp.take_along_axis(sig, ids, axis=-1)
  if cfg.norm_topk_prob:
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), w * fc.routed_scaling_factor, scores


def rank_sigmoid_group(cfg: Any, logits_NxE):
  """The biased sigmoid score sigmoid(logit) + bias: the family's own selection score,
  before its gates are normalised (ranks substitutes)."""
  logits, bias = _split_bias(cfg, logits_NxE.astype(jnp.float32))
  return jax.nn.sigmoid(logits) + bias


# ------------------------------------------------------------------ cache
def init_cache(cfg: Any, batch: int, max_len: int, dtype=jnp.float32) -> list:
  """Per layer: {"k", "v"} (glm4_moe) or the MLA latent cache {"kv": [B,S,R], "k_rot": [B,S,Dr]}."""
  if cfg.model_type in MLA_TYPES:
    fc = cfg.family_config
    return [{"kv": jnp.zeros((batch, max_len, fc.kv_lora_rank), dtype),
             "k_rot": jnp.zeros((batch, max_len, fc.qk_rope_head_dim), dtype)}
            for _ in range(cfg.num_layers)]
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
          for _ in range(cfg.num_layers)]


# ------------------------------------------------------------------ attention
def _mla_rope(c: Any, positions_BxT):
  """cos/sin [B,T,qk_rope_head_dim] and the softmax scale of MLA (default RoPE or YaRN).

  YaRN as transformers computes it for DeepSeek-V3: frequencies and the cos/sin
  factor from ``gpt_oss.rope_inv_freq``; the softmax scale times
  mscale(factor, mscale_all_dim)^2.
  """
  dr = c.family_config.qk_rope_head_dim
  scale = (c.family_config.qk_nope_head_dim + dr) ** -0.5
  if not c.rope_scaling:
    return rope_cos_sin(positions_BxT, dr, c.rope_theta) + (scale,)
  from moejax.model.families import gpt_oss  # pylint: disable=g-import-not-at-top
  inv, attn = gpt_oss.rope_inv_freq(dataclasses.replace(c, head_dim=dr))
  freqs = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  p = dict(c.rope_scaling)
  m_all = p.get("mscale_all_dim") or 0
  if m_all and float(p["factor"]) > 1:
    scale *= (0.1 * m_all * math.log(float(p["factor"])) + 1.0) ** 2
  return jnp.cos(emb) * attn, jnp.sin(emb) * attn, scale


def _rope_interleaved(x_BxTxHxK, cos_BxTxK, sin_BxTxK):
  """DeepSeek's interleaved pairs (x0,x1),(x2,x3)... rotated; output de-interleaved like HF."""
  half = cos_BxTxK.shape[-1] // 2
  cos, sin = cos_BxTxK[:, :, None, :half], sin_BxTxK[:, :, None, :half]
  x1, x2 = x_BxTxHxK[..., 0::2], x_BxTxHxK[..., 1::2]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxK.dtype)


class MLAttention(nn.Module):
  """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash).

  q = q_b(norm(q_a(x))) (or q_proj(x)); the cache holds the normed latent
  c_kv = norm(kv_a(x)[:R]) and the rotated shared key k_rot = rope(kv_a(x)[R:]);
  per-head keys [k_nope | k_rot] and values are expanded from c_kv by kv_b_proj.
  The low-rank norms use eps 1e-6 (HF builds them without the config's eps).
  """
  cfg: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, cache, end_index):
    c, fc = self.cfg, self.cfg.family_config
    b, t, _ = x_BxTxD.shape
    h, dn, dr, dv, r = (c.num_heads, fc.qk_nope_head_dim, fc.qk_rope_head_dim, fc.v_head_dim,
                        fc.kv_lora_rank)
    lin = lambda n, f, bias=False: Linear(f, use_bias=bias, dtype=self.dtype, name=n)
    if fc.q_lora_rank is None:
      q = lin("q_proj", h * (dn + dr))(x_BxTxD)
    else:
      qa = RMSNorm(1e-6, self.dtype, name="q_a_layernorm")(
          lin("q_a_proj", fc.q_lora_rank, c.attention_bias)(x_BxTxD))
      q = lin("q_b_proj", h * (dn + dr))(qa)
    q = q.reshape(b, t, h, dn + dr)
    q_pass, q_rot = q[..., :dn], q[..., dn:]
    ckv = lin("kv_a_proj_with_mqa", r + dr, c.attention_bias)(x_BxTxD)
    kv = RMSNorm(1e-6, self.dtype, name="kv_a_layernorm")(ckv[..., :r])
    k_rot = ckv[..., r:][:, :, None, :]                                   # [B,T,1,Dr]
    cos, sin, scale = _mla_rope(c, positions_BxT)
    rope = _rope_interleaved if fc.rope_interleave else apply_rope
    q_rot, k_rot = rope(q_rot, cos, sin), rope(k_rot, cos, sin)[:, :, 0]
    lat, k_pos, cache = read_cache(cache, {"kv": kv, "k_rot": k_rot}, positions_BxT, end_index)
    kv_all, krot_all = lat["kv"], lat["k_rot"]
    s = kv_all.shape[1]
    w_kvb = _Weight(h * (dn + dv), r, self.dtype, name="kv_b_proj")()    # [H*(dn+dv), R]
    if 2 * t < dn + dv:   # decode: absorb kv_b into q and o (never expands the cache)
      o = _mla_absorbed(q_pass, q_rot, kv_all, krot_all, w_kvb.reshape(h, dn + dv, r), dn,
                        positions_BxT, k_pos, scale)
    else:                 # prefill: expand per-head keys and values once
      kvb = jnp.einsum("bsr,or->bso", kv_all.astype(w_kvb.dtype), w_kvb).reshape(b, s, h, dn + dv)
      keys = jnp.concatenate(
          [kvb[..., :dn], jnp.broadcast_to(krot_all[:, :, None, :].astype(kvb.dtype),
                                           (b, s, h, dr))], axis=-1)
      query = jnp.concatenate([q_pass, q_rot], axis=-1)
      o = gqa_attention(query, keys, kvb[..., dn:], positions_BxT, k_pos, scale)
    return lin("o_proj", c.hidden_size, c.attention_bias)(o), cache


class _Weight(nn.Module):
  """A bare [out, in] ``weight`` parameter (named like a Linear) used as a matrix."""
  features: int
  in_features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self):
    return self.param("weight", nn.initializers.normal(0.02), (self.features, self.in_features),
                      self.dtype)


def _mla_absorbed(q_pass_BxTxHxN, q_rot_BxTxHxR, kv_BxSxC, krot_BxSxR, w_HxOxC, dn,
                  q_pos_BxT, k_pos_BxS, scale):
  """MLA in the latent space: scores = (q_nope W_uk) . c_kv + q_rot . k_rot; out = W_uv (p c_kv).

  Equal to expanding keys/values with kv_b_proj, at O(S * H * C) per query
  instead of O(S * H * C * (dn + dv)) to expand the whole cache.
  """
  dt = q_pass_BxTxHxN.dtype
  w_uk, w_uv = w_HxOxC[:, :dn].astype(dt), w_HxOxC[:, dn:].astype(dt)
  kv = kv_BxSxC.astype(dt)
  q_lat = jnp.einsum("bthn,hnc->bthc", q_pass_BxTxHxN, w_uk)
  sc = (jnp.einsum("bthc,bsc->bhts", q_lat, kv)
        + jnp.einsum("bthr,bsr->bhts", q_rot_BxTxHxR, krot_BxSxR.astype(dt)))
  sc = sc.astype(jnp.float32) * scale
  mask = k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None]
  sc = jnp.where(mask[:, None], sc, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(sc, axis=-1).astype(dt)
  ctx = jnp.einsum("bhts,bsc->bthc", p, kv)
  o = jnp.einsum("bthc,hvc->bthv", ctx, w_uv)
  b, t = o.shape[:2]
  return o.reshape(b, t, -1)


def attention(cfg: Any, dtype):
  """The attention module of a layer of this family (named ``self_attn`` by the caller)."""
  if cfg.model_type in MLA_TYPES:
    return MLAttention(cfg, dtype)
  return Attention(cfg, dtype, o_bias=False)   # q/k/v biases only; partial RoPE


# ------------------------------------------------------------------ MoE block
class SigmoidRouter(nn.Module):
  """``mlp.gate``: weight [E, D] and e_score_correction_bias [E], kept and computed in f32."""
  cfg: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD):
    e = self.cfg.num_experts
    # f32 parameters whatever the model dtype (HF _keep_in_fp32_modules_strict): in bf16 the
    # correction bias and close sigmoid scores would round into different selections.
    w = self.param("weight", nn.initializers.normal(0.02), (e, x_BxTxD.shape[-1]), jnp.float32)
    bias = self.param("e_score_correction_bias", nn.initializers.zeros, (e,), jnp.float32)
    logits = jnp.einsum("...d,ed->...e", x_BxTxD.astype(jnp.float32), w.astype(jnp.float32))
    return jnp.concatenate(
        [logits, jnp.broadcast_to(bias.astype(jnp.float32), logits.shape)], axis=-1)


class SigmoidMoE(nn.Module):
  """``mlp`` of a sparse layer: the router (``gate``) and the shared experts.

  ``__call__`` gives the packed router output [..., 2E]; ``shared_output`` the shared
  experts' output, added ungated to the routed sum by ``DecoderLayer.moe_residual``.
  """
  cfg: Any
  dtype: Any = jnp.float32

  def setup(self):
    c, n = self.cfg, self.cfg.family_config.n_shared_experts
    self.gate = SigmoidRouter(c, self.dtype)
    if n > 0:
      self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * n, self.dtype)

  def __call__(self, x_BxTxD):
    return self.gate(x_BxTxD)

  def shared_output(self, x_BxTxD):
    if self.cfg.family_config.n_shared_experts == 0:
      return jnp.zeros_like(x_BxTxD)
    return self.shared_experts(x_BxTxD)


class Glm(Family):
  """glm4_moe (GQA, partial RoPE), glm4_moe_lite and deepseek_v3 (MLA)."""
  model_types = MODEL_TYPES
  router_rules = {"sigmoid_group": RouterRule(route=route_sigmoid_group,
                                             rank_scores=rank_sigmoid_group)}

  def mixer(self, cfg, layer_idx, dtype):
    return attention(cfg, dtype)

  def sparse_mlp(self, cfg, dtype):
    return SigmoidMoE(cfg, dtype)          # mlp.gate + mlp.shared_experts

  def init_cache(self, cfg, batch, max_len, dtype=jnp.float32):
    return init_cache(cfg, batch, max_len, dtype)


FAMILY = Glm()
