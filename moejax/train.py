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
  balance_coef: float = 0.01
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


def aux_losses(cfg: ModelConfig, router_logits: list):
  """Switch-style load balance E * sum_e f_e P_e (f over top-k picks) and z-loss."""
  bal, z, n = 0.0, 0.0, 0
  for rl in router_logits:
    if rl is None:
      continue
    logits = rl.reshape(-1, cfg.num_experts).astype(jnp.float32)
    ids, _, probs = routing.route(cfg, logits)
    f = jnp.mean(jax.nn.one_hot(ids, cfg.num_experts).sum(1), axis=0) / cfg.top_k
    p = jnp.mean(probs, axis=0)
    bal += cfg.num_experts * jnp.sum(f * p)
    z += jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    n += 1
  return bal / max(n, 1), z / max(n, 1)


def loss_fn(trainable, cfg: ModelConfig, tc: TrainConfig, tokens_BxT1):
  params, experts = trainable
  x, y = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  logits, _, rl = Transformer(cfg).apply({"params": params}, x, experts)
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
  bal, z = aux_losses(cfg, rl)
  return ce + tc.balance_coef * bal + tc.z_coef * z, {"ce": ce, "balance": bal, "z": z}


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(cfg: ModelConfig, tc: TrainConfig, opt, trainable, opt_state, tokens):
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, cfg, tc, tokens)
  updates, opt_state = opt.update(grads, opt_state, trainable)
  trainable = optax.apply_updates(trainable, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
  return trainable, opt_state, metrics


@functools.partial(jax.jit, static_argnums=(0,))
def eval_nll(cfg: ModelConfig, params, experts, tokens_BxT1):
  """Sum of token NLL and token count for a batch (teacher forced)."""
  x, y = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  logits, _, _ = Transformer(cfg).apply({"params": params}, x, experts)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return jnp.sum(nll), nll.size
