"""Training the MoE model: loss with load-balancing and router z-loss, an Optax step.

Routed experts are trained as their own pytree (``experts``), passed to the model
exactly as at inference; expert dispatch is moejax.experts' grouped block path
(gather + batched matmuls, no token dropped).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from moejax import routing
from moejax.config import ModelConfig
from moejax.model import Transformer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1500
  warmup: int = 100
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip: float = 1.0
  balance_coef: float = 0.01        # after balance_switch_step
  balance_coef_start: float = 0.01  # before balance_switch_step
  balance_switch_step: int = 0
  balance_scope: str = "batch"      # "batch": f, P over the whole step; "sequence": per sequence
  locality_coef: float = 0.0        # router consistency between adjacent tokens (0 = off)
  locality_loss: str = "cosine"     # "cosine" (scale-free) or "tv" (rewards flat routers)
  logit_balance_coef: float = 0.0   # pulls every expert's mean centred logit to 0 (revives dead)
  z_coef: float = 1e-3
  batch: int = 16
  seq: int = 256
  seed: int = 0


def make_optimizer(tc: TrainConfig):
  sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps,
                                             end_value=tc.lr * tc.min_lr_ratio)
  decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)
  return optax.chain(optax.clip_by_global_norm(tc.clip),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tc.weight_decay,
                                 mask=decay_mask)), sched


def balance_schedule(tc: TrainConfig, step):
  """The balance-loss coefficient at `step` (a step function: start value, then final)."""
  return jnp.where(step < tc.balance_switch_step, tc.balance_coef_start, tc.balance_coef)


def aux_losses(cfg: ModelConfig, router_logits: list, scope: str = "batch",
               locality: str = "cosine"):
  """Router losses, averaged over MoE layers: (balance, z, locality, logit_balance).

  balance: Switch-style E * sum_e f_e P_e, f = share of top-k picks, P = mean router
    probability; over all tokens of the step (scope "batch") or per sequence, then
    averaged (scope "sequence", which asks every sequence to use every expert).
  z: mean squared logsumexp of the router logits.
  locality: how much the routing of adjacent tokens of a sequence differs (0 = the same):
    "cosine": 1 - cos(z_t, z_t-1) of the centred router logits z = l - mean(l), which
      neither rewards flat nor sharp routers, only a persistent direction of preference;
    "tv": total variation 0.5 * sum_e |p_t,e - p_t-1,e| of the router softmax, which
      is smallest for flat routers (kept for comparison; pilots flattened the gates).
  logit_balance: mean over experts of the squared batch-mean centred logit,
    mean_e (mean_t (l_t,e - mean_e' l_t,e'))^2.  The Switch loss cannot revive an expert
    nobody selects (its f_e = 0, and its probability is too small for the softmax to
    pass a gradient); this term acts on the logits directly, so it can.
  """
  bal, z, loc, lbal, n = 0.0, 0.0, 0.0, 0.0, 0
  for rl in router_logits:
    if rl is None:
      continue
    logits_BxTxE = rl.astype(jnp.float32)
    if logits_BxTxE.ndim == 2:
      logits_BxTxE = logits_BxTxE[None]
    ids, _, probs = routing.route(cfg, logits_BxTxE.reshape(-1, cfg.num_experts))
    picks_BxTxE = jax.nn.one_hot(ids, cfg.num_experts).sum(1).reshape(logits_BxTxE.shape)
    probs_BxTxE = probs.reshape(logits_BxTxE.shape)
    axes = (0, 1) if scope == "batch" else (1,)
    f = jnp.mean(picks_BxTxE, axis=axes) / cfg.top_k
    p = jnp.mean(probs_BxTxE, axis=axes)
    bal += cfg.num_experts * jnp.mean(jnp.sum(f * p, axis=-1))
    z += jnp.mean(jax.nn.logsumexp(logits_BxTxE, axis=-1) ** 2)
    if locality == "tv":
      soft_BxTxE = jax.nn.softmax(logits_BxTxE, axis=-1)
      loc += 0.5 * jnp.mean(jnp.sum(jnp.abs(soft_BxTxE[:, 1:] - soft_BxTxE[:, :-1]), axis=-1))
    else:
      c_BxTxE = logits_BxTxE - jnp.mean(logits_BxTxE, axis=-1, keepdims=True)
      c_BxTxE = c_BxTxE / (jnp.linalg.norm(c_BxTxE, axis=-1, keepdims=True) + 1e-6)
      loc += jnp.mean(1.0 - jnp.sum(c_BxTxE[:, 1:] * c_BxTxE[:, :-1], axis=-1))
    centred = logits_BxTxE - jnp.mean(logits_BxTxE, axis=-1, keepdims=True)
    lbal += jnp.mean(jnp.mean(centred, axis=(0, 1)) ** 2)
    n += 1
  n = max(n, 1)
  return bal / n, z / n, loc / n, lbal / n


def loss_fn(trainable, cfg: ModelConfig, tc: TrainConfig, tokens_BxT1, step):
  params, experts = trainable
  x, y = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  logits, _, rl = Transformer(cfg).apply({"params": params}, x, experts)
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
  bal, z, loc, lbal = aux_losses(cfg, rl, tc.balance_scope, tc.locality_loss)
  loss = (ce + balance_schedule(tc, step) * bal + tc.z_coef * z + tc.locality_coef * loc
          + tc.logit_balance_coef * lbal)
  return loss, {"ce": ce, "balance": bal, "z": z, "locality": loc, "logit_balance": lbal}


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(cfg: ModelConfig, tc: TrainConfig, opt, trainable, opt_state, tokens, step=0):
  """One optimizer step; `step` (the step index, traced) drives the balance schedule."""
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      trainable, cfg, tc, tokens, step)
  updates, opt_state = opt.update(grads, opt_state, trainable)
  trainable = optax.apply_updates(trainable, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
  return trainable, opt_state, metrics
