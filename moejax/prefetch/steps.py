"""Speculative prefetch: the pure prediction and decision functions and the engine's steps.

At MoE layer l, once attention is done (r_l = h), layer l+1's routing is predicted
(DESIGN.md, quasi-hidden state):

  reuse:    router_{l+1}(Norm_{l+1}(r_l))
  quasi:    router_{l+1}(Norm_{l+1}(r_l + d_l)),  d_l = sum_k w_k D_l[e_k]
  previous: layer l+1's true router logits at the previous token (no computation: a
            model whose routing has temporal locality repeats its selections)
  hybrid:   per layer pair the source chosen on held-out data (moejax-train-estimators):
            quasi, quasi plus the trained estimator's correction, or previous

where e_k, w_k are the experts *executed* at layer l and their weights, and D_l the
default vectors.  Every predictor goes through the next layer's own `route_logits`
(its pre-MoE norm and router) and `routing.route`, so each family's rule applies.

Prefetched experts live in R = K rows next to the slot buffers (never in a slot the
cache holds): for the policy they count as resident through a *view* of the layer's
`ResidentState` whose `expert_slot` maps prefetched expert j to row P + 1 + j of the
table `buffers ++ rows` (P physical slots, then the scratch row).

Speculative execution (`speculative`):
  off                the true router decides, through `policy.decide` on the view (a
                     mispredicted expert goes through the miss rule);
  predicted_weights  `decide` on the *predicted* logits: layer l+1 runs the predicted
                     experts with the predictor's own gates (the family's rule applied
                     to the predicted logits); the true router is evaluated for the
                     statistics only;
  true_router        the predicted experts, with the true router's weights restricted
                     to them (`restricted_gates`).
The first MoE layer always uses its true routing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.prefetch.estimator import estimate
from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.model.model import DecoderLayer
from moejax.cache import policy as policy_lib
from moejax.cache.policy import FETCH, HIT, HOST, SUBSTITUTE
from moejax.cache.step import Prediction
from moejax.cache.step import view  # noqa: F401  (public: the state the policy sees)

PREFETCH = ("none", "reuse", "quasi", "previous", "hybrid", "oracle")
SPECULATIVE = ("off", "predicted_weights", "true_router")


# ------------------------------------------------------------------ pure functions
def restricted_gates(cfg: ModelConfig, logits_NxE: jax.Array, ids_NxK: jax.Array) -> jax.Array:
  """The true router's gate weights applied to the experts `ids` (not its own top-k).

  softmax: p = softmax(logits) over all experts, p[ids], divided by their sum when the
  family renormalises (norm_topk_prob; mixtral's family always sets it); topk_softmax (gpt_oss): softmax over
  logits[ids]; sigmoid_group: sigmoid(logits)[ids] (unbiased), normalised when
  norm_topk_prob, times routed_scaling_factor.  With ids = the true top-k these are
  exactly `routing.route`'s gates."""
  logits = logits_NxE.astype(jnp.float32)
  take = lambda a: jnp.take_along_axis(a, ids_NxK, axis=-1)
  if cfg.router == "softmax":
    g = take(jax.nn.softmax(logits, axis=-1))
    if cfg.norm_topk_prob:  # mixtral's family sets it
      g = g / jnp.sum(g, axis=-1, keepdims=True)
    return g
  if cfg.router == "topk_softmax":
    return jax.nn.softmax(take(logits), axis=-1)
  if cfg.router == "sigmoid_group":
    g = take(jax.nn.sigmoid(logits[..., :cfg.num_experts]))
    if cfg.norm_topk_prob:
      g = g / (jnp.sum(g, axis=-1, keepdims=True) + 1e-20)
    return g * cfg.family_config.routed_scaling_factor
  raise ValueError(f"unknown router rule {cfg.router!r} for model_type {cfg.model_type}")


def quasi_offset(exec_ids_K: jax.Array, weights_K: jax.Array, vectors_ExD: jax.Array):
  """d_l = sum_k w_k D_l[e_k] over the executed experts (e_k >= 0) -> [D]."""
  w = jnp.where(exec_ids_K >= 0, weights_K, 0.0)
  return jnp.einsum("k,kd->d", w, vectors_ExD[jnp.maximum(exec_ids_K, 0)].astype(jnp.float32))


def predict_logits(mod_next: DecoderLayer, p_next, r_1xD, d_D, estimator, kind: str,
                   last: Prediction | None = None):
  """Layer l+1's predicted router logits [1, E'] from r_l (and d_l unless `reuse`);
  `last`: layer l+1's true logits [1, E'] at the previous token and whether there was
  one (a `Prediction`), the input of an estimator that takes it
  (`moejax.prefetch.estimator`)."""
  x = r_1xD if kind == "reuse" else r_1xD + d_D.astype(r_1xD.dtype)[None]
  q, logits = mod_next.apply({"params": p_next}, x, method="route_logits")
  if estimator is not None:
    logits = estimate(estimator, q, logits, *((None, None) if last is None else
                                              (last.logits_1xE, last.has)))
  return logits.astype(jnp.float32)


def speculative_decision(cfg: ModelConfig, true_1xE, pred_1xE, state_view, decision,
                         speculative: str) -> policy_lib.Decision:
  """The decision of a layer under `speculative` (see the module docstring)."""
  if speculative == "off":
    return policy_lib.decide(true_1xE, state_view, decision, cfg)
  dec = policy_lib.decide(pred_1xE, state_view, decision, cfg)
  if speculative == "true_router":
    g = restricted_gates(cfg, true_1xE, dec.ids)
    runs = (dec.action == HIT) | (dec.action == FETCH) | (dec.action == SUBSTITUTE) | (
        dec.action == HOST)
    dec = dataclasses.replace(dec, gates=g, weights=jnp.where(runs, g, 0.0))
  return dec


# ------------------------------------------------------------------ modes
@dataclasses.dataclass(frozen=True)
class Prefetch:
  """The engine's speculative prefetch: the predictor `kind` (prefetch.PREFETCH;
  "none": off), speculative execution, the predictors' files (`load_predictors`; None:
  the shipped ones) and `streaming` (no expert cache: every expert of a token is fetched
  or prefetched)."""
  kind: str = "none"
  speculative: str = "off"
  predictors: dict | None = dataclasses.field(default=None, compare=False, hash=False)
  streaming: bool = False


@dataclasses.dataclass(frozen=True)
class Mode:
  """What the engine's prefetch does (hashable: keys the jitted steps)."""
  prefetch: str = "none"
  speculative: str = "off"
  keep: bool = True            # insert the prefetched experts used into the cache

  def __post_init__(self):
    if self.prefetch not in PREFETCH:
      raise ValueError(f"--prefetch must be one of {', '.join(PREFETCH)}, got {self.prefetch!r}")
    if self.speculative not in SPECULATIVE:
      raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE)}, got "
                       f"{self.speculative!r}")
    if self.speculative != "off" and self.prefetch == "none":
      raise ValueError(f"--speculative={self.speculative} executes predicted experts: it "
                       f"needs --prefetch=reuse, quasi, previous or hybrid")

  @property
  def on(self) -> bool:
    return self.prefetch != "none"




def predicted(cfg: ModelConfig, mod, p, prefetch: str, est, use_last, r_prev, d_prev, has,
              last: Prediction, true_1xE) -> Prediction:
  """This layer's predicted routing: router logits [1, E'] and whether there is a
  prediction.

  From the previous MoE layer's (r, d) through this layer's own norm and router
  (`predict_logits`), from `last` (this layer's true logits at the previous token and
  whether there was one) for `previous` (and where the hybrid's `use_last` says so),
  or this layer's true logits (`oracle`: a check, not a predictor).  No prediction
  reaches the first MoE layer (`has` False): its true routing decides."""
  if prefetch == "oracle":
    return Prediction(true_1xE.astype(jnp.float32), has)
  if prefetch == "previous":
    return Prediction(last.logits_1xE, has & last.has)
  pred = predict_logits(mod, p, r_prev, d_prev, est, prefetch, last)
  if use_last is not None and prefetch == "hybrid":
    pred = jnp.where(use_last, last.logits_1xE, pred)
    has = has & (~use_last | last.has)
  return Prediction(pred, has)
