"""Each family's router rule: router logits -> selected experts and their gate weights.

`route` is the single implementation used by the model, the offload policy, the
emulator and the simulator.  Scores are what "first choice" is ranked by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig


def route(cfg: ModelConfig, logits_NxE: jax.Array):
  """Returns (ids_NxK int32, gates_NxK f32, scores_NxE f32), ids sorted by score desc.

  ``gates`` are the weights the model applies to each selected expert, after the
  family's own normalisation.  ``scores`` rank the experts (softmax probabilities
  for the softmax families).
  """
  logits = logits_NxE.astype(jnp.float32)
  if cfg.router == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    top_s, ids = jax.lax.top_k(scores, cfg.top_k)
    gates = top_s
    if cfg.norm_topk_prob or cfg.model_type == "mixtral":
      gates = top_s / jnp.sum(top_s, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), gates, scores
  if cfg.router == "topk_softmax":
    # gpt_oss: top-k of the raw logits (router has a bias), softmax over those k values.
    # scores = softmax over all experts: the same ranking as the logits, bounded in [0, 1].
    top_l, ids = jax.lax.top_k(logits, cfg.top_k)
    return ids.astype(jnp.int32), jax.nn.softmax(top_l, axis=-1), jax.nn.softmax(logits, axis=-1)
  if cfg.router == "sigmoid_group":
    return _sigmoid_group(cfg, logits)
  raise ValueError(f"unknown router rule {cfg.router!r} for model_type {cfg.model_type}")


def rank_scores(cfg: ModelConfig, logits_NxE: jax.Array) -> jax.Array:
  """[N,E] f32 router scores that rank substitutes: the raw logits for the softmax
  families (the same order as their probabilities, without underflow to ties), the
  biased sigmoid score sigmoid(logit) + bias for sigmoid_group (the family's own
  selection score, before its gates are normalised)."""
  logits = logits_NxE.astype(jnp.float32)
  if cfg.router in ("softmax", "topk_softmax"):
    return logits
  if cfg.router == "sigmoid_group":
    logits, bias = _split_bias(cfg, logits)
    return jax.nn.sigmoid(logits) + bias
  raise ValueError(f"unknown router rule {cfg.router!r} for model_type {cfg.model_type}")


def _split_bias(cfg: ModelConfig, logits):
  """A sigmoid_group router output [..., 2E] -> (logits, correction bias)."""
  e = cfg.num_experts
  if logits.shape[-1] == 2 * e:
    return logits[..., :e], logits[..., e:]
  if logits.shape[-1] == e:
    return logits, jnp.zeros_like(logits)
  raise ValueError(f"router output has {logits.shape[-1]} columns; a sigmoid_group router "
                   f"of {e} experts gives {2 * e} (logits, correction bias) or {e}")


def _sigmoid_group(cfg: ModelConfig, logits):
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
  e, g = cfg.num_experts, cfg.n_group
  logits, bias = _split_bias(cfg, logits)
  sig = jax.nn.sigmoid(logits)
  scores = sig + bias
  choice = scores
  if g > 1:
    per = scores.reshape(scores.shape[:-1] + (g, e // g))
    group_scores = jnp.sum(jax.lax.top_k(per, 2)[0], axis=-1)                 # [..., G]
    _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
    group_mask = jnp.any(jax.nn.one_hot(keep, g, dtype=jnp.bool_), axis=-2)    # [..., G]
    choice = jnp.where(jnp.repeat(group_mask, e // g, axis=-1), scores, -jnp.inf)
  _, ids = jax.lax.top_k(choice, cfg.top_k)
  w = jnp.take_along_axis(sig, ids, axis=-1)
  if cfg.norm_topk_prob:
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), w * cfg.routed_scaling_factor, scores
