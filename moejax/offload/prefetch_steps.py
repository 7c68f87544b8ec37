"""Speculative prefetch: the pure prediction and decision functions and the engine's steps.

At MoE layer l, once attention is done (r_l = h), layer l+1's routing is predicted
(DESIGN.md, quasi-hidden state):

  reuse:    router_{l+1}(Norm_{l+1}(r_l))
  quasi:    router_{l+1}(Norm_{l+1}(r_l + d_l)),  d_l = sum_k w_k D_l[e_k]
  previous: layer l+1's true router logits at the previous token (no computation: a
            model whose routing has temporal locality repeats its selections)
  hybrid:   per layer pair the source chosen on held-out data (launch.train_estimators):
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
import functools

import jax
import jax.numpy as jnp

from estimators.model import estimate
from moejax import routing
from moejax.config import ModelConfig
from moejax.model import DecoderLayer
from moejax.offload import policy as policy_lib
from moejax.offload import resident as resident_lib
from moejax.offload.policy import FETCH, HIT, HOST, SUBSTITUTE
from moejax.offload.steps import _attend_route, pack_decision

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
    return g * cfg.routed_scaling_factor
  raise ValueError(f"unknown router rule {cfg.router!r} for model_type {cfg.model_type}")


def quasi_offset(exec_ids_K: jax.Array, weights_K: jax.Array, vectors_ExD: jax.Array):
  """d_l = sum_k w_k D_l[e_k] over the executed experts (e_k >= 0) -> [D]."""
  w = jnp.where(exec_ids_K >= 0, weights_K, 0.0)
  return jnp.einsum("k,kd->d", w, vectors_ExD[jnp.maximum(exec_ids_K, 0)].astype(jnp.float32))


def predict_logits(mod_next: DecoderLayer, p_next, r_1xD, d_D, estimator, kind: str,
                   last=None):
  """Layer l+1's predicted router logits [1, E'] from r_l (and d_l unless `reuse`);
  `last` = (layer l+1's true logits [1, E'] at the previous token, whether there was
  one), the input of an estimator that takes it (`estimators.model`)."""
  x = r_1xD if kind == "reuse" else r_1xD + d_D.astype(r_1xD.dtype)[None]
  q, logits = mod_next.apply({"params": p_next}, x, method="route_logits")
  if estimator is not None:
    logits = estimate(estimator, q, logits, *(last if last is not None else (None, None)))
  return logits.astype(jnp.float32)


def view(state: resident_lib.ResidentState, pf_ids_R: jax.Array) -> resident_lib.ResidentState:
  """The state the policy sees: prefetched expert j (pf_ids_R[j] >= 0, not in a slot)
  resident at table row P + 1 + j."""
  num_e, num_p = state.expert_slot.shape[0], state.slot_expert.shape[0]
  pf = jnp.where(pf_ids_R >= 0, pf_ids_R, num_e)
  row = num_p + 1 + jnp.arange(pf_ids_R.shape[0], dtype=jnp.int32)
  free = state.expert_slot[jnp.minimum(pf, num_e - 1)] < 0
  slot = state.expert_slot.at[jnp.where(free, pf, num_e)].set(row, mode="drop")
  return dataclasses.replace(state, expert_slot=slot)


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


# ------------------------------------------------------------------ engine steps
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


@functools.lru_cache(maxsize=None)
def spec_fns(cfg: ModelConfig, dtype, layer_idx: int, decision, cache, mode: Mode,
             budget_slots: int | None, first: bool) -> dict:
  """The un-jitted prefetch versions of a MoE layer's decide and moe functions:

    attend_decide(p, x, tp, kv, state, pf_ids_R, pred_1xE, has_pred)
        -> h, moe_in, kv, dec, packed [5K + E + K] (the decision, then the true ids),
           the true logits [1, E'] (what `previous` predicts from at the next token);
           has_pred False: no prediction reached the layer, its true routing decides
    moe(p, h, moe_in, dec, host_out, state, pf_ids_R, rows)
        -> y, state, evicted: experts from `buffers ++ rows`, usage update, the used
           prefetched experts inserted into the cache (mode.keep), trim to the budget.
  `first`: the first MoE layer (no prediction reaches it: the true router decides).
  """
  mod = DecoderLayer(cfg, True, dtype, layer_idx)
  spec = "off" if first else mode.speculative
  num_e = cfg.num_experts

  def attend_decide(p, x, tp, kv, state, pf_ids_R, pred_1xE, has_pred):
    pos, end = tp[1].reshape(1, 1), tp[1]
    h, moe_in, logits, kv = mod.apply({"params": p}, x, pos, kv, end, method=_attend_route)
    true = logits.reshape(1, -1)
    v = view(state, pf_ids_R)
    dec = speculative_decision(cfg, true, pred_1xE, v, decision, spec)
    if spec != "off":        # a layer no prediction reached decides on its true routing
      off = speculative_decision(cfg, true, pred_1xE, v, decision, "off")
      dec = jax.tree_util.tree_map(lambda a, b: jnp.where(has_pred, a, b), dec, off)
    true_ids = routing.route(cfg, true)[0][0]
    return (h, moe_in, kv, dec, jnp.concatenate([pack_decision(dec), true_ids.astype(jnp.float32)]),
            true.astype(jnp.float32))

  def moe(p, h, moe_in, dec, host_out, state, pf_ids_R, rows):
    e = dec.exec_ids
    row = view(state, pf_ids_R).expert_slot[jnp.maximum(e, 0)]
    w = jnp.where(e >= 0, dec.weights, 0.0)
    table = {k: jnp.concatenate([state.buffers[k], rows[k].astype(state.buffers[k].dtype)])
             for k in state.buffers}
    y = mod.apply({"params": p}, h, moe_in, row.reshape(1, 1, -1), w.reshape(1, 1, -1), table,
                  method="moe_residual")
    state = policy_lib.update_usage(state, dec, cache)
    evicted = [jnp.full((pf_ids_R.shape[0],), -1, jnp.int32)]
    if mode.keep:
      used = jnp.any(pf_ids_R[:, None] == e.reshape(1, -1), axis=1) & (pf_ids_R >= 0)
      in_use = jnp.zeros((num_e + 1,), bool).at[jnp.where(e >= 0, e, num_e).reshape(-1)].set(
          True)[:num_e]
      state, evicted[0] = resident_lib.insert(state, jnp.where(used, pf_ids_R, -1), rows,
                                              in_use, cache)
    if budget_slots is not None:
      state, ev = resident_lib.trim(state, budget_slots, cache)
      evicted.append(ev)
    return y + host_out.astype(y.dtype), state, jnp.concatenate(evicted)

  return dict(attend_decide=attend_decide, moe=moe)


def predict_fn(cfg: ModelConfig, dtype, next_idx: int, kind: str, with_estimator: bool):
  """predict(p_next, h, dec, vectors_ExD, estimator, last logits [1, E'], has last) ->
  (pred logits [1, E'], ids [K]): layer `next_idx`'s routing predicted at the MoE layer
  before it (un-jitted)."""
  mod = DecoderLayer(cfg, True, dtype, next_idx)

  def predict(p_next, h, dec, vectors, estimator, last, has_last):
    r = h.reshape(1, -1)
    d = quasi_offset(dec.exec_ids[0], dec.weights[0], vectors)
    logits = predict_logits(mod, p_next, r, d, estimator if with_estimator else None, kind,
                            (last, has_last))
    return logits, routing.route(cfg, logits)[0][0]

  return predict


@functools.lru_cache(maxsize=None)
def layer_steps(cfg: ModelConfig, dtype, layer_idx: int, decision, cache, mode: Mode,
                budget_slots: int | None, first: bool) -> dict:
  """The jitted `spec_fns` of a MoE layer kind: attend_decide and moe as separate calls
  (the layer before a dense layer, the last MoE layer, the `oracle` check)."""
  f = spec_fns(cfg, dtype, layer_idx, decision, cache, mode, budget_slots, first)
  return dict(attend_decide=jax.jit(f["attend_decide"], donate_argnums=(3,)),
              moe=jax.jit(f["moe"], donate_argnums=(5,)))


@functools.lru_cache(maxsize=None)
def decide_steps(cfg: ModelConfig, dtype, layer_idx: int, first: bool, prev: tuple | None,
                 next_idx: int | None, decision, cache, mode: Mode, budget_slots: int | None,
                 with_estimator: bool):
  """One call per MoE layer with speculative prefetch: the previous MoE layer's moe call
  (`prev` = (its kind's layer, whether it is the first MoE layer); None: none pending),
  this layer's attention and decision, and the prediction of the next MoE layer's
  routing (`next_idx`'s kind; None: nothing predicted here: the last MoE layer, a
  `previous` source, the `oracle` check), in one dispatch and one host read:

    step(state', moe_args | None, p, x | None, tp, kv, state, pf_ids, pred, has_pred,
         predict_args | None)
      state'       the previous layer's ResidentState (None without moe_args)
      moe_args     = (p', h', moe_in', dec', host_out', pf_ids', rows') of the previous
                     layer, whose output is this layer's input (x None)
      predict_args = (p_next, vectors_ExD, estimator, last logits [1, E'], has last):
                     the next layer's true logits at the previous token (`estimators.model`)
      -> (h, moe_in, kv, dec, packed [5K + E + K (+ K predicted ids)], true logits [1, E'],
          predicted logits [1, E'] | None, state' | None, evicted' | None)

  The same functions as the separate steps (`layer_steps`, `predict_fn`), in the same
  order; layer kinds are given by their representative layers (`steps.representative`)."""
  f = spec_fns(cfg, dtype, layer_idx, decision, cache, mode, budget_slots, first)
  fp = spec_fns(cfg, dtype, prev[0], decision, cache, mode, budget_slots, prev[1]) if prev else None
  fn = (predict_fn(cfg, dtype, next_idx, mode.prefetch, with_estimator)
        if next_idx is not None else None)

  @functools.partial(jax.jit, donate_argnums=(0, 5))
  def step(prev_state, moe_args, p, x, tp, kv, state, pf_ids, pred, has_pred, predict_args):
    evicted = None
    if fp is not None:
      pp, ph, pin, pdec, phost, ppf, prows = moe_args
      x, prev_state, evicted = fp["moe"](pp, ph, pin, pdec, phost, prev_state, ppf, prows)
    h, moe_in, kv, dec, packed, true = f["attend_decide"](p, x, tp, kv, state, pf_ids, pred,
                                                          has_pred)
    pred_next = None
    if fn is not None:
      p_next, vectors, est, last, has_last = predict_args
      pred_next, ids = fn(p_next, h, dec, vectors, est, last, has_last)
      packed = jnp.concatenate([packed, ids.astype(jnp.float32)])
    return h, moe_in, kv, dec, packed, true, pred_next, prev_state, evicted

  return step


@functools.lru_cache(maxsize=None)
def oracle_step(cfg: ModelConfig, dtype, next_idx: int):
  """The true router logits of layer `next_idx` from its input x (its attention run on
  a copy of its cache, not donated): a check of speculative execution, not a predictor."""
  mod = DecoderLayer(cfg, True, dtype, next_idx)

  @jax.jit
  def oracle(p_next, x, tp, kv):
    pos, end = tp[1].reshape(1, 1), tp[1]
    _, _, logits, _ = mod.apply({"params": p_next}, x, pos, kv, end, method=_attend_route)
    logits = logits.reshape(1, -1).astype(jnp.float32)
    return logits, routing.route(cfg, logits)[0][0]

  return oracle


def speculate(cfg, mod, p, est, prev, logits_1xE, state, decision, prefetch: str,
              speculative: str, dec_true, last=None, use_last=None):
  """The emulator's decision with speculative prefetch (the functions above, as the
  engine's steps use them); `dec_true` is the decision on the true routing, used where
  no prediction was made (`prev`'s flag: no previous MoE layer; `last`'s: no previous
  token for a `previous` source):
  this layer's routing predicted from the previous MoE layer's (r, d), or taken from
  `last` = (this layer's true logits [1, E'] at the previous token, flag) where
  `use_last` (a traced bool: the hybrid's per-layer choice), the predicted experts not
  resident prefetched (seen as resident), the decision on the view.
  Returns (decision, prefetched ids [K] (-1: none), prefetch stats [4])."""
  r_prev, d_prev, has = prev
  if prefetch == "previous":
    pred, has = last[0], has & last[1]
  else:
    pred = predict_logits(mod, p, r_prev, d_prev, est, prefetch, last)
    if use_last is not None:
      pred = jnp.where(use_last, last[0], pred)
      has = has & (~use_last | last[1])
  pred_ids = routing.route(cfg, pred)[0][0]
  pf_ids = jnp.where(has & (state.expert_slot[pred_ids] < 0), pred_ids, -1)
  dec_spec = speculative_decision(cfg, logits_1xE, pred, view(state, pf_ids), decision,
                                  speculative)
  dec = jax.tree_util.tree_map(lambda a, b: jnp.where(has, a, b), dec_spec, dec_true)
  true_ids = routing.route(cfg, logits_1xE)[0][0]
  used = jnp.any(pf_ids[:, None] == dec.exec_ids[0][None, :], axis=1) & (pf_ids >= 0)
  hits = jnp.sum(jnp.any(pred_ids[:, None] == true_ids[None, :], axis=1))
  f = jnp.float32
  stats = jnp.stack([jnp.sum(pf_ids >= 0).astype(f), jnp.sum(used).astype(f),
                     jnp.where(has, hits, 0).astype(f), jnp.where(has, cfg.top_k, 0).astype(f)])
  return dec, jnp.where(used, pf_ids, -1).astype(jnp.int32), stats
