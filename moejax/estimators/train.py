"""Training one estimator per MoE-layer pair with Optax.

Loss: KL(softmax(true logits) || softmax(predicted logits)) over all experts, plus
`topk_weight` x the cross-entropy of the predicted distribution against the uniform
distribution over the true top-k set (`topk_ce`).  KL matches the whole distribution, so
it also matches the gate weights speculative execution takes from the same softmax; but
it weighs each expert by its true probability, and the k-th choice of a flat 64-expert
top-8 router carries ~0.07 of it, so the experts at the set's edge -- where recall@k is
won or lost -- get the least gradient.  The top-k term gives every member of the true set
the same weight (`topk_weight=0`: KL alone).  The epoch with the lowest held-out loss
(the training objective: `history`'s "loss") is kept (early stopping); held-out recall@k
and KL are reported per epoch.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from moejax.prefetch.estimator import LogitCorrection
from moejax.prefetch import speculation


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
  hidden: int = 64
  lr: float = 3e-3
  weight_decay: float = 1e-4
  batch: int = 512
  epochs: int = 8
  patience: int = 2
  seed: int = 0
  topk_weight: float = 0.0   # weight of topk_ce beside the KL (0: KL alone)


def kl_loss(pred_NxE, true_NxE):
  logp_true = jax.nn.log_softmax(true_NxE.astype(jnp.float32), -1)
  logp_pred = jax.nn.log_softmax(pred_NxE, -1)
  return jnp.mean(jnp.sum(jnp.exp(logp_true) * (logp_true - logp_pred), -1))


def topk_ce(pred_NxE, true_NxE, k: int):
  """Cross-entropy of softmax(pred) against the uniform distribution over the true top-k
  experts: -(1/k) sum_{i in topk(true)} log softmax(pred)_i."""
  _, idx_NxK = jax.lax.top_k(true_NxE.astype(jnp.float32), k)
  logp = jax.nn.log_softmax(pred_NxE, -1)
  return -jnp.mean(jnp.take_along_axis(logp, idx_NxK, -1))


def loss_fn(pred_NxE, true_NxE, k: int, topk_weight: float):
  loss = kl_loss(pred_NxE, true_NxE)
  return loss + topk_weight * topk_ce(pred_NxE, true_NxE, k) if topk_weight else loss


def _optimizer(ec: EstimatorConfig, steps: int):
  sched = optax.warmup_cosine_decay_schedule(0.0, ec.lr, max(1, steps // 20), max(2, steps))
  return optax.adamw(sched, weight_decay=ec.weight_decay)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _step(model, opt, k, topk_weight, params, opt_state, q, base, true):
  loss, grads = jax.value_and_grad(
      lambda p: loss_fn(model.apply(p, q, base), true, k, topk_weight))(params)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnums=(0,))
def _predict(model, params, q, base):
  return model.apply(params, q, base)


def evaluate(model_cfg, model, params, held: dict, chunk: int = 4096,
             topk_weight: float = 0.0) -> dict:
  """Held-out recall@k, exact match, mass covered, KL and the training loss ("loss")."""
  preds = np.concatenate([np.asarray(_predict(model, params, jnp.asarray(held["q"][s:s + chunk]),
                                              jnp.asarray(held["quasi"][s:s + chunk])))
                          for s in range(0, len(held["q"]), chunk)])
  out = speculation.topk_agreement(model_cfg, jnp.asarray(held["true"], jnp.float32), preds)
  pred, true = jnp.asarray(preds), jnp.asarray(held["true"])
  out["kl"] = float(kl_loss(pred, true))
  out["loss"] = float(loss_fn(pred, true, model_cfg.top_k, topk_weight))
  return out


def train_pair(model_cfg, train: dict, held: dict, ec: EstimatorConfig, ckpt_dir: str,
               progress=None, stop_at: int | None = None):
  """Trains one pair's estimator; resumes from ckpt_dir.  Returns (best params, history).

  `stop_at` ends the run after that epoch (checkpointed), as a kill would.
  History holds the epochs run by this call (epoch 0 = the untrained quasi predictor)."""
  n, d = train["q"].shape
  model = LogitCorrection(model_cfg.num_experts, ec.hidden)
  params = model.init(jax.random.PRNGKey(ec.seed), jnp.zeros((1, d)),
                      jnp.zeros((1, model_cfg.num_experts)))
  steps_per_epoch = max(1, n // ec.batch)
  opt = _optimizer(ec, steps_per_epoch * ec.epochs)
  opt_state = opt.init(params)
  ev_of = lambda p: evaluate(model_cfg, model, p, held, topk_weight=ec.topk_weight)
  base = ev_of(params)                                    # = the plain quasi predictor
  state = {"params": params, "opt_state": opt_state, "best_params": params,
           "epoch": 0, "best_loss": base["loss"], "bad_epochs": 0}
  mgr = ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                              options=ocp.CheckpointManagerOptions(max_to_keep=1))
  if mgr.latest_step() is not None:
    state = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(state))
  history = [dict(base, epoch=0)]
  epochs = range(int(state["epoch"]), ec.epochs if stop_at is None else min(stop_at, ec.epochs))
  for epoch in (progress(epochs) if progress else epochs):
    if int(state["bad_epochs"]) >= ec.patience:
      break
    perm = np.random.default_rng(ec.seed + epoch).permutation(n)
    p, o = state["params"], state["opt_state"]
    for s in range(steps_per_epoch):
      idx = perm[s * ec.batch:(s + 1) * ec.batch]
      p, o, _ = _step(model, opt, model_cfg.top_k, ec.topk_weight, p, o,
                      jnp.asarray(train["q"][idx]), jnp.asarray(train["quasi"][idx]),
                      jnp.asarray(train["true"][idx]))
    ev = ev_of(p)
    history.append(dict(ev, epoch=epoch + 1))
    better = ev["loss"] < float(state["best_loss"])
    state = {"params": p, "opt_state": o, "best_params": p if better else state["best_params"],
             "epoch": epoch + 1, "best_loss": min(ev["loss"], float(state["best_loss"])),
             "bad_epochs": 0 if better else int(state["bad_epochs"]) + 1}
    mgr.save(epoch + 1, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
  mgr.close()
  return state["best_params"], history
