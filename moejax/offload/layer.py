"""One MoE layer of a decoded token: the per-layer sequence, written once.

`policy_step` is the cache's side of a layer, pure over its `ResidentState`, its
router logits and the admissions requested at the previous token:

  1. insert those admissions (ascending ids, nothing protected);
  2. decide (`policy.decide`, a control rule, or the speculative decision on the
     view in which the experts prefetched for this layer count as resident);
  3. insert the FETCH experts (the token's executed experts protected);
  4. `policy.update_usage`;
  5. insert the prefetched experts the layer executed (speculative prefetch, unless
     streaming);
  6. trim back to the budget (a layer with staging slots).

It returns the new state and a `Step`: the decision, the copies the inserts need
(expert id -> slot, in insert order), the buffer row each executed expert is read
from, the evictions, the admissions for the next token and the layer's counts.

`moe_layer` runs a decoder layer around it: attention and router, the prediction
(speculative prefetch), `policy_step`, then the experts from an *expert source*:

  table   every expert on the device, read by id: the emulator (idealised link);
  slots   the layer's slot buffers, filled by in-program copies from the host store
          (`copy_rows`); HOST experts computed from the store where it lives: the
          engine.

The simulator calls `policy_step` alone, on recorded router logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from moejax import experts as experts_lib
from moejax import routing
from moejax.config import ModelConfig
from moejax.offload import policy as policy_lib
from moejax.offload import prefetch_steps as pf
from moejax.offload import resident as resident_lib
from moejax.offload.policy import DROP, FETCH, HIT, HOST, SUBSTITUTE

# per-layer counts of a decoded token (summed over MoE layers by the drivers)
STATS = ("expert_calls", "hits", "fetches", "substituted", "substituted_mass", "dropped",
         "dropped_mass", "host_calls", "admissions", "admitted", "evictions", "prefetches",
         "useful_prefetches", "recall_hits", "predicted_calls", "first_substituted")


@dataclasses.dataclass(frozen=True)
class Ctx:
  """What is static about a layer's step (hashable: part of a jit key)."""
  cfg: ModelConfig
  policy: policy_lib.PolicyParams
  trim_to: int | None                 # budget slots S when there are staging slots
  prefetch: str = "none"              # prefetch_steps.PREFETCH
  speculative: str = "off"
  keep: bool = True                   # executed prefetches enter the cache (False: streaming)
  control: Any = None                 # controls.Control (emulator studies)
  source: str = "table"               # "table" (emulator) | "slots" (engine)
  pinned: bool = False                # the host store is in pinned_host memory

  @property
  def spec_on(self) -> bool:
    return self.prefetch != "none"


class Step(NamedTuple):
  """What one MoE layer of one token decided and did (device arrays)."""
  dec: policy_lib.Decision
  admitted: jax.Array      # [K] admissions inserted before the decision (-1: none)
  copy_ids: jax.Array      # [J] experts to copy into slots, in insert order
  copy_slots: jax.Array    # [J] their slots (-1: nothing to copy)
  rows: jax.Array          # [K] buffer row of each executed expert (-1: none)
  fetched: jax.Array       # [K] FETCH experts (-1: none)
  pf_ids: jax.Array        # [K] prefetched experts (not resident when predicted; -1)
  predicted: jax.Array     # [K] the experts predicted for this layer (-1: no prediction)
  true_ids: jax.Array      # [K] the true router's top-k
  evicted: jax.Array       # [2K (+K) + P] experts evicted here (-1: none)
  pending: jax.Array       # [K] admissions requested now, for the next token
  stats: jax.Array         # [len(STATS)] f32


def first_k(mask_E, k: int):
  """The first k set positions of mask_E in increasing order, -1 padded (k x E compares:
  jnp.nonzero with a size is a sort on XLA CPU)."""
  rank = jnp.cumsum(mask_E) - 1
  hit = mask_E[None, :] & (rank[None, :] == jnp.arange(k)[:, None])
  return jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), -1).astype(jnp.int32)


def placed(before, after, ids_J):
  """The slot each of ids_J went into (-1: skipped, already resident, or not placed)."""
  num_e = before.expert_slot.shape[0]
  e = jnp.clip(ids_J, 0, num_e - 1)
  new = (ids_J >= 0) & (before.expert_slot[e] < 0) & (after.expert_slot[e] >= 0)
  return jnp.where(new, after.expert_slot[e], -1).astype(jnp.int32)


def _in_use(ids, num_e: int):
  return jnp.zeros((num_e + 1,), bool).at[jnp.where(ids >= 0, ids, num_e).reshape(-1)].set(
      True)[:num_e]


def policy_step(cfg: ModelConfig, decision, cache, trim_to, state, pending_K, logits_1xE, *,
                decide_fn: Callable | None = None, spec=None, keep: bool = True,
                speculative: str = "off"):
  """The cache's side of one MoE layer (module docstring) -> (state, Step).

  decision, cache: the policy's parts (`DecideParams`, `CacheParams`; the simulator
  passes copies with traced tau/beta/decay).  decide_fn(logits, state) replaces
  `policy.decide` (a control rule).  spec = (predicted logits [1, E'], whether there is
  a prediction) turns on speculative prefetch.
  """
  num_e, k = cfg.num_experts, cfg.top_k
  num_p = state.slot_expert.shape[0]
  decide = decide_fn or (lambda lg, st: policy_lib.decide(lg, st, decision, cfg))
  st0 = state
  admitted = pending_K
  if decision.admission_beta is not None:
    state, ev_adm = resident_lib.insert(state, pending_K, None, jnp.zeros((num_e,), bool), cache)
  else:
    admitted = jnp.full((k,), -1, jnp.int32)
    ev_adm = admitted
  adm_slots = placed(st0, state, admitted)
  pf_ids = predicted = jnp.full((k,), -1, jnp.int32)
  pf_stats = jnp.zeros((4,), jnp.float32)
  if spec is None:
    dec = decide(logits_1xE, state)
    true_ids = dec.ids[0]
  else:
    pred, has = spec
    pred_ids = routing.route(cfg, pred)[0][0]
    predicted = jnp.where(has, pred_ids, -1).astype(jnp.int32)
    pf_ids = jnp.where(has & (state.expert_slot[pred_ids] < 0), pred_ids, -1).astype(jnp.int32)
    dec_spec = pf.speculative_decision(cfg, logits_1xE, pred, pf.view(state, pf_ids), decision,
                                       speculative)
    dec = jax.tree_util.tree_map(lambda a, b: jnp.where(has, a, b), dec_spec,
                                 decide(logits_1xE, state))
    true_ids = routing.route(cfg, logits_1xE)[0][0]
    used = jnp.any(pf_ids[:, None] == dec.exec_ids[0][None, :], axis=1) & (pf_ids >= 0)
    hits = jnp.sum(jnp.any(pred_ids[:, None] == true_ids[None, :], axis=1))
    f = jnp.float32
    pf_stats = jnp.stack([jnp.sum(pf_ids >= 0).astype(f), jnp.sum(used).astype(f),
                          jnp.where(has, hits, 0).astype(f), jnp.where(has, k, 0).astype(f)])
  act = dec.action[0]
  fetched = jnp.where(act == FETCH, dec.ids[0], -1).astype(jnp.int32)
  in_use = _in_use(dec.exec_ids[0], num_e)
  st1 = state
  state, ev_fetch = resident_lib.insert(state, fetched, None, in_use, cache)
  fetch_slots = placed(st1, state, fetched)
  # the row each executed expert is read from: its slot, or its prefetch row
  view = pf.view(state, pf_ids) if spec is not None else state
  rows = jnp.where(dec.exec_ids[0] >= 0,
                   view.expert_slot[jnp.maximum(dec.exec_ids[0], 0)], -1).astype(jnp.int32)
  state = policy_lib.update_usage(state, dec, cache)
  copy_ids = [admitted, fetched]
  copy_slots = [adm_slots, fetch_slots]
  evicted = [ev_adm, ev_fetch]
  if spec is not None:
    pf_used = jnp.where(jnp.any(pf_ids[:, None] == dec.exec_ids[0][None, :], axis=1), pf_ids, -1)
    ev_pf = jnp.full((k,), -1, jnp.int32)
    if keep:
      st2 = state
      state, ev_pf = resident_lib.insert(state, pf_used, None, in_use, cache)
      copy_ids.append(pf_used)
      copy_slots.append(placed(st2, state, pf_used))
    evicted.append(ev_pf)
  ev_trim = jnp.full((num_p,), -1, jnp.int32)
  if trim_to is not None:          # staging slots hold the token in flight only
    state, ev_trim = resident_lib.trim(state, trim_to, cache)
  evicted = jnp.concatenate(evicted + [ev_trim])
  share = dec.share[0]
  is_ = lambda a: (act == a).astype(jnp.float32)
  stats = jnp.stack([
      jnp.float32(k), jnp.sum(is_(HIT)), jnp.sum(is_(FETCH)), jnp.sum(is_(SUBSTITUTE)),
      jnp.sum(is_(SUBSTITUTE) * share), jnp.sum(is_(DROP)), jnp.sum(is_(DROP) * share),
      jnp.sum(is_(HOST)), jnp.sum(dec.admit.astype(jnp.float32)),
      jnp.sum((admitted >= 0).astype(jnp.float32)),
      jnp.sum((evicted >= 0).astype(jnp.float32)), *pf_stats,
      is_(SUBSTITUTE)[0] + is_(DROP)[0]])
  return state, Step(dec, admitted, jnp.concatenate(copy_ids), jnp.concatenate(copy_slots),
                     rows, fetched, pf_ids, predicted, true_ids.astype(jnp.int32), evicted,
                     first_k(dec.admit, k), stats)


# ------------------------------------------------------------------ expert sources
def copy_rows(buffers: dict, store: dict, ids_J, slots_J, pinned: bool,
              loop: bool = False) -> dict:
  """Copies store[k][ids_J[j]] into buffers[k][slots_J[j]] for every j with a slot, in
  order (a later copy into the same slot wins), inside the program.

  Decode steps (`loop` False) take one `lax.switch` on the number of copies: its branch
  n makes exactly n slices of the store, so a skipped entry copies nothing, at one
  data-dependent branch per call (a GPU's cheapest: ~40 us, a while loop ~150 us).  A
  prompt's copies (up to E) take a `fori_loop` instead (the switch's size grows as J^2).
  A pinned_host store's slices are moved to device memory."""
  j_max = ids_J.shape[0]
  if j_max == 0:
    return buffers
  valid = slots_J >= 0
  at = jnp.where(valid, jnp.cumsum(valid) - 1, j_max)
  ids = jnp.zeros((j_max,), jnp.int32).at[at].set(ids_J, mode="drop")
  slots = jnp.zeros((j_max,), jnp.int32).at[at].set(slots_J, mode="drop")
  n = jnp.sum(valid).astype(jnp.int32)

  def copy_one(j, bufs):
    bufs = dict(bufs)
    for name, buf in bufs.items():
      row = jax.lax.dynamic_slice_in_dim(store[name], ids[j], 1, axis=0)
      if pinned:
        row = jax.device_put(row, jax.memory.Space.Device)
      bufs[name] = jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), slots[j],
                                                       axis=0)
    return bufs

  if loop:
    return jax.lax.fori_loop(0, n, copy_one, dict(buffers))

  def branch(count):
    def copy(bufs):
      for j in range(count):
        bufs = copy_one(j, bufs)
      return dict(bufs)
    return copy

  return jax.lax.switch(n, [branch(c) for c in range(j_max + 1)], dict(buffers))


def copy_prefetch(buffers: dict, store: dict, pf_ids_K, num_p: int, pinned: bool) -> dict:
  """The prefetched experts into their rows P + 1 + j (`prefetch_steps.view`)."""
  rows = jnp.where(pf_ids_K >= 0, num_p + 1 + jnp.arange(pf_ids_K.shape[0]), -1)
  return copy_rows(buffers, store, pf_ids_K, rows.astype(jnp.int32), pinned)


def _swiglu(cfg: ModelConfig):
  return (cfg.swiglu_alpha, cfg.swiglu_limit)


def run_experts(ctx: Ctx, mod, p, src: dict, h, moe_in, state, step: Step):
  """The layer's experts and residual from the source -> (x, state)."""
  dec, k = step.dec, ctx.cfg.top_k
  run = dec.exec_ids[0]
  if ctx.source == "table":        # every expert on the device: by id; HOST exact
    run = jnp.where(dec.action[0] == HOST, dec.ids[0], run)
    w = jnp.where(run >= 0, dec.weights[0], 0.0)
    x = mod.apply({"params": p}, h, moe_in, jnp.maximum(run, 0).reshape(1, 1, k),
                  w.reshape(1, 1, k), src["table"], method="moe_residual")
    return x, state
  store, bufs = src["store"], state.buffers
  num_p = state.slot_expert.shape[0]
  if ctx.spec_on:
    bufs = copy_prefetch(bufs, store, step.pf_ids, num_p, ctx.pinned)
  bufs = copy_rows(bufs, store, step.copy_ids, step.copy_slots, ctx.pinned)
  state = dataclasses.replace(state, buffers=bufs)
  w = jnp.where(step.rows >= 0, dec.weights[0], 0.0)
  x = mod.apply({"params": p}, h, moe_in, jnp.maximum(step.rows, 0).reshape(1, 1, k),
                w.reshape(1, 1, k), bufs, method="moe_residual")
  if ctx.policy.miss == "host":    # computed where the store lives (the CPU backend)
    host = dec.action[0] == HOST
    wh = jnp.where(host, dec.weights[0], 0.0)
    y = experts_lib.apply_experts(moe_in.reshape(1, -1), jnp.where(host, dec.ids[0], 0)[None],
                                  wh[None], store, swiglu=_swiglu(ctx.cfg))
    x = x + y.reshape(x.shape).astype(x.dtype)
  return x, state


# ------------------------------------------------------------------ the layer
def attend_route(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  moe_in, logits = mdl.route_logits(h)
  return h, moe_in, logits, cache


def dense(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  return mdl.dense_residual(h), cache


def moe_layer(ctx: Ctx, mod, p, src: dict, x, pos_11, cache, state, pending, key):
  """One MoE layer of one decoded token -> (x, cache, state, pending, Step).

  Without prefetch x is [1, 1, D] and pending the admissions [K].  With prefetch x is
  (x, r, d, has): the previous MoE layer's post-attention residual r, its offset d and
  whether there was one; pending is (admissions [K], this layer's true logits at the
  previous token [1, E'], whether there was one); src has the layer's predictor
  ("vectors", "est", "use_last").
  """
  cfg = ctx.cfg
  apply = lambda *a, method: mod.apply({"params": p}, *a, method=method)
  xin = x[0] if ctx.spec_on else x
  h, moe_in, logits, cache = apply(xin, pos_11, cache, pos_11[0, 0], method=attend_route)
  lg = logits.reshape(1, -1)
  decide_fn = None
  if ctx.control is not None:
    from moejax import controls   # pylint: disable=import-outside-toplevel
    decide_fn = lambda l, s: controls.decide(ctx.control, l, s, ctx.policy.decision, cfg, key)
  spec = None
  adm = pending[0] if ctx.spec_on else pending
  if ctx.spec_on:
    _, r_prev, d_prev, has = x
    last = (pending[1], pending[2])
    hybrid = ctx.prefetch == "hybrid"
    spec = pf.predicted(cfg, mod, p, ctx.prefetch, src["est"] if hybrid else None,
                        src["use_last"] if hybrid else None, r_prev, d_prev, has, last, lg)
  state, step = policy_step(cfg, ctx.policy.decision, ctx.policy.cache, ctx.trim_to, state, adm,
                            lg, decide_fn=decide_fn, spec=spec, keep=ctx.keep,
                            speculative=ctx.speculative)
  x_out, state = run_experts(ctx, mod, p, src, h, moe_in, state, step)
  if ctx.spec_on:
    d = pf.quasi_offset(step.dec.exec_ids[0], step.dec.weights[0], src["vectors"])
    return ((x_out, h.reshape(1, -1), d, jnp.bool_(True)), cache, state,
            (step.pending, lg.astype(jnp.float32), jnp.bool_(True)), step)
  return x_out, cache, state, step.pending, step
