"""One MoE layer of a decoded token: the per-layer sequence, written once.

`policy_step` is the cache's side of a layer, pure over its `ResidentState` and its
router logits:

  1. decide (`policy.decide`, a control rule, or the speculative decision on the
     view in which the experts prefetched for this layer count as resident);
  2. insert the FETCH experts (the token's executed experts protected);
  3. `policy.update_usage`;
  4. insert the prefetched experts the layer executed (speculative prefetch, unless
     streaming);
  5. insert the admissions this token requested (ascending ids, nothing protected;
     their rows are copied at the next token, before the layer's experts run);
  6. trim back to the budget S (a layer with staging slots), the admissions evicted
     last: between tokens a layer holds at most S experts.

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

from moejax.kernels import cpu_rows
from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.cache import policy as policy_lib
from moejax.prefetch import steps as pf
from moejax.cache import resident as resident_lib
from moejax.cache.policy import DROP, FETCH, FETCH_LOW, HIT, HOST, SUBSTITUTE
from moejax.offload.sources import run_experts

# per-layer counts of a decoded token (summed over MoE layers by the drivers)
STATS = ("expert_calls", "hits", "fetches", "substituted", "substituted_mass", "dropped",
         "dropped_mass", "host_calls", "admissions", "admitted", "evictions", "prefetches",
         "useful_prefetches", "recall_hits", "predicted_calls", "fetches_low", "low_mass",
         "first_substituted")


@dataclasses.dataclass(frozen=True)
class Ctx:
  """What is static about a layer's step (hashable: part of a jit key)."""
  cfg: ModelConfig
  policy: policy_lib.PolicyParams
  trim_to: int | None                 # budget slots S when there are staging slots
  prefetch: str = "none"              # prefetch.PREFETCH
  speculative: str = "off"
  keep: bool = True                   # executed prefetches enter the cache (False: streaming)
  control: Any = None                 # controls.Control (emulator studies)
  source: str = "table"               # "table" (emulator) | "slots" (engine)
  pinned: bool = False                # the host store is in pinned_host memory
  defer_tail: bool = False            # `policy_tail` after the last layer (token.decode)
  skip_empty: bool = False            # inserts under a cond (`_maybe`): the CPU backend
  all_resident: bool = False          # every expert resident for good: all hits
  ep: Any = None                      # expert_parallel.Plan: slots over a device mesh

  @property
  def spec_on(self) -> bool:
    return self.prefetch != "none"


class Head(NamedTuple):
  """A MoE layer's decision and what its experts need now (`policy_head`)."""
  dec: policy_lib.Decision
  fetched: jax.Array       # [K] FETCH and FETCH_LOW experts (-1: none)
  fetch_slots: jax.Array   # [K] their slots (-1: nothing to copy)
  fetch_low: jax.Array     # [K] bool: the fetch is of the low-precision copy
  rows: jax.Array          # [K] buffer row of each executed expert (-1: none)
  pf_ids: jax.Array        # [K] prefetched experts (not resident when predicted; -1)
  predicted: jax.Array     # [K] the experts predicted for this layer (-1: no prediction)
  true_ids: jax.Array      # [K] the true router's top-k
  evicted: jax.Array       # [K] evicted by the fetch insert
  pf_stats: jax.Array      # [4] prefetches, useful ones, recall hits, predicted calls


class Step(NamedTuple):
  """What one MoE layer of one token decided and did (`policy_step`)."""
  head: Head
  kept: jax.Array          # [K] prefetched experts inserted after the layer (-1: none)
  kept_slots: jax.Array    # [K] their slots (copied from the store at the next token)
  evicted: jax.Array       # [K (+K) + P] evicted by this token's inserts and trim
  pending: tuple           # for the next token: (admissions inserted [K], their slots [K],
                           # their evictions [K], executed prefetches kept [K], their slots)

  @property
  def dec(self) -> policy_lib.Decision:
    return self.head.dec


def no_pending(k: int) -> tuple:
  """A layer's `Step.pending` at the start of a stream: nothing (five arrays: a donated
  carry must not hold one buffer twice)."""
  return tuple(jnp.full((k,), -1, jnp.int32) for _ in range(5))


def counts(xp, action, share, admissions, admitted, evicted, pf_stats):
  """The `STATS` of MoE layers (leading axes kept, the last reduced): the same numbers
  in jnp inside the emulator's scan and in numpy from the engine's packed decisions.
  admissions: ids requested now; admitted: ids inserted for this token (-1 padded)."""
  f32 = lambda a: xp.asarray(a, xp.float32)
  n = lambda m: xp.sum(f32(m), axis=-1)
  sub, drop, low = f32(action == SUBSTITUTE), f32(action == DROP), f32(action == FETCH_LOW)
  k = xp.full(action.shape[:-1], action.shape[-1], xp.float32)
  return xp.stack([k, n(action == HIT), n(action == FETCH), n(sub), xp.sum(sub * share, axis=-1),
                   n(drop), xp.sum(drop * share, axis=-1), n(action == HOST),
                   n(admissions >= 0), n(admitted >= 0), n(evicted >= 0),
                   *[pf_stats[..., i] for i in range(4)], xp.sum(low, axis=-1),
                   xp.sum(low * share, axis=-1), sub[..., 0] + drop[..., 0]], axis=-1)


def first_k(mask_E, k: int):
  """The first k set positions of mask_E in increasing order, -1 padded: the top k of
  -position over the set ones (`cpu_rows.top_k`, one kernel call on CPU; k chained
  minimums over E were 8 thunks of their own, 7% of a simulator sweep, and a rank by
  `prefix_count` is E x E compares)."""
  num_e = mask_E.shape[-1]
  neg = jnp.where(mask_E, -jnp.arange(num_e, dtype=jnp.float32), -jnp.inf)
  vals, pos = cpu_rows.top_k(neg, k)
  return jnp.where(vals > -jnp.inf, pos, -1).astype(jnp.int32)


def placed(before, after, ids_J):
  """The slot each of ids_J went into (-1: skipped, already resident, or not placed)."""
  num_e = before.expert_slot.shape[0]
  e = jnp.clip(ids_J, 0, num_e - 1)
  new = (ids_J >= 0) & (before.expert_slot[e] < 0) & (after.expert_slot[e] >= 0)
  return jnp.where(new, after.expert_slot[e], -1).astype(jnp.int32)


def _in_use(ids, num_e: int):
  return jnp.any(ids.reshape(-1, 1) == jnp.arange(num_e), axis=0)     # ids < 0 match none


def _insert(state, ids, in_use, cache, skip_empty: bool, low=None):
  """resident.insert -> (state, evicted, slots); with skip_empty under a cond on there
  being anything to insert (cheap on a CPU, where it saves the insert's work; a GPU
  runs it unconditionally: a data-dependent branch there costs more than the insert)."""
  def run(st):
    new, ev = resident_lib.insert(st, ids, None, in_use, cache, low)
    return new, ev, placed(st, new, ids)
  if not skip_empty:
    return run(state)
  none = jnp.full(ids.shape, -1, jnp.int32)
  return jax.lax.cond(jnp.any(ids >= 0), run, lambda st: (st, none, none), state)


def policy_head(cfg: ModelConfig, decision, cache, state, logits_1xE, *,
                decide_fn: Callable | None = None, spec=None, speculative: str = "off",
                skip_empty: bool = False, all_resident: bool = False, routed=None):
  """Steps 1-2 (module docstring): the decision and the fetch inserts -> (state, Head):
  what the layer's experts need; `policy_tail` finishes the step.  all_resident: every
  expert is resident for good (a budget that holds them all, filled at the start), so
  `decide` can only answer HIT and nothing is inserted: the decision is the routing."""
  num_e, k = cfg.num_experts, cfg.top_k
  none_K = jnp.full((k,), -1, jnp.int32)
  if all_resident and spec is None and decide_fn is None:
    dec = policy_lib.all_hits(logits_1xE, state, cfg)
    return state, Head(dec, none_K, none_K, jnp.zeros((k,), bool), state.expert_slot[dec.ids[0]],
                       none_K, none_K, dec.ids[0], none_K, jnp.zeros((4,), jnp.float32))
  decide = decide_fn or (lambda lg, st: policy_lib.decide(lg, st, decision, cfg, routed))
  pf_ids = predicted = none_K
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
  fetch_low = dec.action[0] == FETCH_LOW
  fetched = jnp.where((dec.action[0] == FETCH) | fetch_low, dec.ids[0], -1).astype(jnp.int32)
  state, ev_fetch, fetch_slots = _insert(state, fetched, _in_use(dec.exec_ids[0], num_e), cache,
                                         skip_empty, fetch_low)
  # the row each executed expert is read from: its slot, or its prefetch row
  seen = pf.view(state, pf_ids) if spec is not None else state
  rows = jnp.where(dec.exec_ids[0] >= 0,
                   seen.expert_slot[jnp.maximum(dec.exec_ids[0], 0)], -1).astype(jnp.int32)
  return state, Head(dec, fetched, fetch_slots, fetch_low, rows, pf_ids, predicted,
                     true_ids.astype(jnp.int32), ev_fetch, pf_stats)


def policy_tail(cfg: ModelConfig, decision, cache, trim_to, state, head: Head, *,
                spec_on: bool = False, keep: bool = True, skip_empty: bool = False):
  """Steps 3-6: usage, the executed prefetches into the cache, this token's admission
  requests inserted for the next token, then the trim -> (state, Step).  It touches
  only the layer's own state and nothing its experts read this token, so the engine
  runs it for every MoE layer at once after the last layer (vmapped)."""
  k, num_e = cfg.top_k, cfg.num_experts
  dec = head.dec
  none_K = jnp.full((k,), -1, jnp.int32)
  state = policy_lib.update_usage(state, dec, cache)
  kept = kept_slots = none_K
  evicted = [head.evicted]
  if spec_on:
    ev_pf = none_K
    if keep:
      kept = jnp.where(jnp.any(head.pf_ids[:, None] == dec.exec_ids[0][None, :], axis=1),
                       head.pf_ids, -1)
      state, ev_pf, kept_slots = _insert(state, kept, _in_use(dec.exec_ids[0], num_e), cache,
                                         skip_empty)
    evicted.append(ev_pf)
  adm = ev_adm = adm_slots = none_K
  if decision.admission_beta is not None:   # in place before the layer's next decision
    adm = first_k(dec.admit, k)
    state, ev_adm, adm_slots = _insert(state, adm, jnp.zeros((num_e,), bool), cache, skip_empty)
    if decision.low:   # an admitted low-precision resident: full rows into its own slot
      e = jnp.maximum(adm, 0)
      up = (adm >= 0) & (state.expert_slot[e] >= 0) & state.low[e] & (adm_slots < 0)
      adm_slots = jnp.where(up, state.expert_slot[e], adm_slots)
      state = dataclasses.replace(state, low=state.low & ~_in_use(jnp.where(up, adm, -1), num_e))
  ev_trim = jnp.full(state.slot_expert.shape, -1, jnp.int32)
  if trim_to is not None:   # staging slots hold the token in flight only; the trim comes
    # after the admissions (evicted last), so between tokens a layer holds at most S
    slot_s = jnp.arange(state.slot_expert.shape[0])
    prot = jnp.any((adm_slots[:, None] == slot_s[None, :]) & (adm_slots[:, None] >= 0), axis=0)
    state, ev_trim = resident_lib.trim(state, trim_to, cache, prot)
    gone = (adm >= 0) & (state.expert_slot[jnp.maximum(adm, 0)] < 0)   # more than S admitted
    adm, adm_slots = jnp.where(gone, -1, adm), jnp.where(gone, -1, adm_slots)
  pending = (adm, adm_slots, ev_adm, kept, kept_slots)
  return state, Step(head, kept, kept_slots, jnp.concatenate(evicted + [ev_trim]), pending)


def policy_step(cfg: ModelConfig, decision, cache, trim_to, state, logits_1xE, *,
                decide_fn: Callable | None = None, spec=None, keep: bool = True,
                speculative: str = "off", routed=None):
  """The cache's side of one MoE layer (module docstring) -> (state, Step): `policy_head`
  then `policy_tail`.

  decision, cache: the policy's parts (`DecideParams`, `CacheParams`; the simulator
  passes copies with traced tau/beta/decay).  decide_fn(logits, state) replaces
  `policy.decide` (a control rule).  spec = (predicted logits [1, E'], whether there is
  a prediction) turns on speculative prefetch.  routed: `policy.route_once` of the logits,
  computed beforehand (the simulator routes a trace once for all its policies; spec=None).
  """
  state, head = policy_head(cfg, decision, cache, state, logits_1xE, decide_fn=decide_fn,
                            spec=spec, speculative=speculative, routed=routed)
  return policy_tail(cfg, decision, cache, trim_to, state, head, spec_on=spec is not None,
                     keep=keep)


def layer_counts(step: Step, prev_pending: tuple):
  """`counts` of one layer's step (jnp): the admissions inserted for this token and
  their evictions come from the previous token's tail (`prev_pending`)."""
  h = step.head
  return counts(jnp, h.dec.action[0], h.dec.share[0], step.pending[0], prev_pending[0],
                jnp.concatenate([prev_pending[2], step.evicted]), h.pf_stats)


# ------------------------------------------------------------------ the layer
def attend_route(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  moe_in, logits = mdl.route_logits(h)
  return h, moe_in, logits, cache


def dense(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  return mdl.dense_residual(h), cache


def moe_layer(ctx: Ctx, mod, p, src: dict, x, pos_11, cache, state, pending, key):
  """One MoE layer of one decoded token -> (x, cache, state, pending, (out, admitted)):
  out is the layer's Step, or with `ctx.defer_tail` its Head (the caller runs
  `policy_tail` after the last layer, which gives the new pending admissions);
  admitted is the pending triple this token consumed (inserted at the previous token's
  end: counted here, where it takes effect).

  Without prefetch x is [1, 1, D] and pending the admission triple (`Step.pending`).
  With prefetch x is (x, r, d, has): the previous MoE layer's post-attention residual
  r, its offset d and whether there was one; pending is (the admission triple, this
  layer's true logits at the previous token [1, E'], whether there was one); src has
  the layer's predictor ("vectors", "est", "use_last").
  """
  cfg = ctx.cfg
  apply = lambda *a, method: mod.apply({"params": p}, *a, method=method)
  xin = x[0] if ctx.spec_on else x
  h, moe_in, logits, cache = apply(xin, pos_11, cache, pos_11[0, 0], method=attend_route)
  lg = logits.reshape(1, -1)
  decide_fn = None
  if ctx.control is not None:
    from moejax.cache import controls   # pylint: disable=import-outside-toplevel
    decide_fn = lambda l, s: controls.decide(ctx.control, l, s, ctx.policy.decision, cfg, key)
  spec = None
  admitted = pending[0] if ctx.spec_on else pending
  if ctx.spec_on:
    _, r_prev, d_prev, has = x
    last = (pending[1], pending[2])
    hybrid = ctx.prefetch == "hybrid"
    spec = pf.predicted(cfg, mod, p, ctx.prefetch, src["est"] if hybrid else None,
                        src["use_last"] if hybrid else None, r_prev, d_prev, has, last, lg)
  state, head = policy_head(cfg, ctx.policy.decision, ctx.policy.cache, state, lg,
                            decide_fn=decide_fn, spec=spec, speculative=ctx.speculative,
                            skip_empty=ctx.skip_empty, all_resident=ctx.all_resident)
  x_out, state = run_experts(ctx, mod, p, src, h, moe_in, state, head, admitted)
  out, adm = head, admitted
  if not ctx.defer_tail:
    state, out = policy_tail(cfg, ctx.policy.decision, ctx.policy.cache, ctx.trim_to, state,
                             head, spec_on=ctx.spec_on, keep=ctx.keep)
    adm = out.pending
  if ctx.spec_on:
    d = pf.quasi_offset(head.dec.exec_ids[0], head.dec.weights[0], src["vectors"])
    return ((x_out, h.reshape(1, -1), d, jnp.bool_(True)), cache, state,
            (adm, lg.astype(jnp.float32), jnp.bool_(True)), (out, admitted))
  return x_out, cache, state, adm, (out, admitted)
