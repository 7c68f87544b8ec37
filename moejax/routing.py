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
  raise ValueError(f"unknown router rule {cfg.router!r} for model_type {cfg.model_type}")
