"""Training the MoE model: loss with load-balancing and router z-loss, an Optax step.

Routed experts are trained as their own pytree (``experts``), passed to the model
exactly as at inference; expert dispatch is moejax.model.experts' grouped block path
(gather + batched matmuls, no token dropped).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer


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
  locality_loss: str = "cosine"     # "cosine" | "tv" (adjacent tokens) | "mi" (sequence vs batch)
  logit_balance_coef: float = 0.0   # pulls every expert's mean centred logit to 0 (revives dead)
  z_coef: float = 1e-3
  revive_every: int = 0             # split loaded experts into dead ones every N steps (0 = off)
  revive_threshold: float = 0.25    # dead = share of the window's picks below this / E
  revive_until: float = 0.8         # no revival after this fraction of the steps
  revive_noise: float = 0.1         # router-row perturbation, relative to the row's RMS
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
    "mi": H(p_b) - H(p), the mean entropy of each sequence's mean router softmax p_b
      minus the entropy of the whole step's mean p; minus the mutual information
      between sequence and expert.  It asks each sequence (one document window) to use
      few experts and the step as a whole to use all of them evenly, so, unlike the
      adjacent-token forms, a constant routing preference does not minimise it.
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
    if locality == "mi":
      soft_BxTxE = jax.nn.softmax(logits_BxTxE, axis=-1)
      entropy = lambda p: -jnp.sum(p * jnp.log(p + 1e-9), axis=-1)
      loc += jnp.mean(entropy(jnp.mean(soft_BxTxE, axis=1))) - entropy(
          jnp.mean(soft_BxTxE, axis=(0, 1)))
    elif locality == "tv":
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


def expert_loads(cfg: ModelConfig, router_logits: list):
  """Share of each layer's top-k picks per expert, [MoE layers, E] (rows sum to 1)."""
  loads = []
  for rl in router_logits:
    if rl is None:
      continue
    ids, _, _ = routing.route(cfg, rl.astype(jnp.float32).reshape(-1, cfg.num_experts))
    loads.append(jnp.mean(jax.nn.one_hot(ids, cfg.num_experts).sum(1), axis=0) / cfg.top_k)
  return jnp.stack(loads)


def revive_experts(trainable, load_LxE, threshold: float, noise: float, seed: int):
  """Splits the most loaded experts into the dead ones: (trainable, revived per layer).

  An expert whose share of its layer's picks is below `threshold / E` is dead.  Each dead
  expert d takes a donor j, the layer's most loaded experts in order: d gets j's expert
  weights, and the two router rows become w_j + n and w_j - n with n a Gaussian of
  `noise` times the row's RMS, so d and j split j's tokens along a random direction and
  both keep learning.  The Switch loss cannot do this: an expert nobody picks gets no
  gradient through its top-k share, and its softmax probability is too small to
  pull it back.  Optimizer moments are left as they are (the dead row's are near zero).
  `load_LxE` covers the MoE layers in order; `seed` makes the noise reproducible.
  """
  params, experts = trainable
  load_LxE = np.asarray(load_LxE)
  E = load_LxE.shape[-1]
  rng = np.random.default_rng(seed)
  params = dict(params)  # new dicts along the changed paths; the arrays are immutable
  experts = list(experts)
  revived = []
  moe_layers = [i for i, e in enumerate(experts) if e is not None]
  for row, li in enumerate(moe_layers):
    load = load_LxE[row]
    dead = np.flatnonzero(load < threshold / E)
    donors = [j for j in np.argsort(-load, kind="stable") if j not in set(dead)]
    revived.append(int(dead.size))
    if dead.size == 0:
      continue
    name = f"layers_{li}"
    w_ExD = params[name]["mlp"]["gate"]["weight"]
    ex = dict(experts[li])
    for n, d in enumerate(dead):
      j = donors[n % len(donors)]
      rms = jnp.sqrt(jnp.mean(w_ExD[j] ** 2))
      eps = jnp.asarray(rng.standard_normal(w_ExD.shape[1]), w_ExD.dtype) * noise * rms
      w_ExD = w_ExD.at[d].set(w_ExD[j] + eps).at[j].set(w_ExD[j] - eps)
      ex = {k: v.at[d].set(v[j]) for k, v in ex.items()}
    layer = dict(params[name])
    layer["mlp"] = dict(layer["mlp"], gate=dict(layer["mlp"]["gate"], weight=w_ExD))
    params[name] = layer
    experts[li] = ex
  return (params, experts), revived


def loss_fn(trainable, cfg: ModelConfig, tc: TrainConfig, tokens_BxT1, step):
  params, experts = trainable
  x, y = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  logits, _, rl = Transformer(cfg).apply({"params": params}, x, experts)
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
  bal, z, loc, lbal = aux_losses(cfg, rl, tc.balance_scope, tc.locality_loss)
  loss = (ce + balance_schedule(tc, step) * bal + tc.z_coef * z + tc.locality_coef * loc
          + tc.logit_balance_coef * lbal)
  return loss, {"ce": ce, "balance": bal, "z": z, "locality": loc, "logit_balance": lbal,
                "load": expert_loads(cfg, rl)}


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(cfg: ModelConfig, tc: TrainConfig, opt, trainable, opt_state, tokens, step=0):
  """One optimizer step; `step` (the step index, traced) drives the balance schedule."""
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      trainable, cfg, tc, tokens, step)
  updates, opt_state = opt.update(grads, opt_state, trainable)
  trainable = optax.apply_updates(trainable, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
  return trainable, opt_state, metrics
