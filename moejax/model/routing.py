"""Router rules: router logits -> selected experts and their gate weights.

`route` is the single implementation used by the model, the offload policy, the
emulator and the simulator.  It dispatches on ``cfg.router``, the rule's name:
``softmax`` is defined here; a family with its own rule contributes it through
``Family.router_rules`` (``topk_softmax`` in ``families/gpt_oss.py``,
``sigmoid_group`` in ``families/glm.py``).

Ties go to the lowest expert id, and -0.0 ties +0.0: XLA's top_k orders floats by their
bits (+0.0 above -0.0), so `route` hands the rules logits with canonical zeros
(`canonical_zeros`) and `rank_scores` returns canonical scores, which the offload
policy's substitute top_k ranks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.kernels import cpu_rows
from moejax.model import families
from moejax.model.config import ModelConfig
from moejax.model.families.base import RouterRule


class Routed(NamedTuple):
  """`route`'s result, read by field name (a NamedTuple: a pytree, and callers that unpack
  it as (ids, gates, scores) keep working)."""
  ids: jax.Array      # [N, K] int32 the selected experts, by score (desc)
  gates: jax.Array    # [N, K] f32 their weights, after the family's own normalisation
  scores: jax.Array   # [N, E] f32 what ranks the experts (softmax probabilities for softmax)


@jax.custom_jvp
def canonical_zeros(x: jax.Array) -> jax.Array:
  """`x` with -0.0 replaced by +0.0 (NaN, inf and every other value unchanged), so that
  top_k, which ranks +0.0 above -0.0, breaks their tie by the lowest index.  A select
  XLA keeps under jit (it folds `x + 0.0`); its derivative is the identity's."""
  return jnp.where(x == 0, jnp.zeros_like(x), x)


@canonical_zeros.defjvp
def _canonical_zeros_jvp(primals, tangents):
  return canonical_zeros(primals[0]), tangents[0]


def route_softmax(cfg: ModelConfig, logits_NxE: jax.Array):
  """Softmax over all experts, top-k of the probabilities, renormalised if norm_topk_prob:
  one kernel call on CPU (cpu_rows), `xla_softmax_rule` elsewhere."""
  xla_fn = functools.partial(xla_softmax_rule, cfg.top_k, cfg.norm_topk_prob)
  return cpu_rows.route_softmax(logits_NxE, cfg.top_k, cfg.norm_topk_prob, xla_fn)


def xla_softmax_rule(top_k: int, norm_topk_prob: bool, logits_NxE: jax.Array):
  """The softmax rule in XLA ops: (ids, gates, scores)."""
  scores = jax.nn.softmax(logits_NxE, axis=-1)
  top_s, ids = jax.lax.top_k(scores, top_k)
  gates = top_s
  if norm_topk_prob:
    gates = top_s / jnp.sum(top_s, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), gates, scores


def rank_logits(cfg: ModelConfig, logits_NxE: jax.Array) -> jax.Array:
  """The raw logits: the order of the softmax probabilities, without underflow to ties."""
  del cfg
  return logits_NxE


RULES = {"softmax": RouterRule(route=route_softmax, rank_scores=rank_logits),
         **families.router_rules()}
# rules whose ranking cannot see the sign of a zero logit: softmax ranks exp(l - max), the
# same for -0.0 and +0.0, so its hot path (one CPU kernel call) gets no extra op
SIGN_OF_ZERO_FREE = frozenset({"softmax"})


def _rule(cfg: ModelConfig) -> RouterRule:
  if cfg.router not in RULES:
    raise ValueError(f"unknown router rule {cfg.router!r} for model_type {cfg.model_type}; "
                     f"known rules: {', '.join(RULES)}")
  return RULES[cfg.router]


def router_width(cfg: ModelConfig) -> int:
  """The width of a router's output row: E, or 2E for sigmoid_group (logits, then the
  correction bias)."""
  return cfg.num_experts * (2 if cfg.router == "sigmoid_group" else 1)


def route(cfg: ModelConfig, logits_NxE: jax.Array) -> Routed:
  """The `Routed` (ids [N, K] int32, gates [N, K] f32, scores [N, E] f32), ids sorted by
  score desc.

  ``gates`` are the weights the model applies to each selected expert, after the
  family's own normalisation.  ``scores`` rank the experts (softmax probabilities
  for the softmax families).
  """
  logits_NxE = logits_NxE.astype(jnp.float32)
  if cfg.router not in SIGN_OF_ZERO_FREE:
    logits_NxE = canonical_zeros(logits_NxE)
  ids, gates, scores = _rule(cfg).route(cfg, logits_NxE)   # a rule's (ids, gates, scores)
  return Routed(ids=ids, gates=gates, scores=scores)


def rank_scores(cfg: ModelConfig, logits_NxE: jax.Array) -> jax.Array:
  """[N,E] f32 router scores that rank substitutes: the raw logits for the softmax
  rules, the biased sigmoid score sigmoid(logit) + bias for sigmoid_group (the
  family's own selection score, before its gates are normalised), with canonical zeros
  (no -0.0), so a top_k of them gives ties to the lowest id."""
  return canonical_zeros(_rule(cfg).rank_scores(cfg, logits_NxE.astype(jnp.float32)))
