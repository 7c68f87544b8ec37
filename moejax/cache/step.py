"""The cache's side of one MoE layer of one token, or of a batch of B tokens sharing the
layer's cache: the per-layer step, written once.

`policy_step(rule, state, router, prediction, key)` is pure over the layer's
`ResidentState` and its routing:

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

Steps 1-2 are `policy_head` (what the layer's experts need now), 3-6 `policy_tail`,
which touches nothing the experts read this token: the engine and the emulator run
every MoE layer's tail at once after the last layer (`policy_tails`, vmapped); the
router-trace simulator runs `policy_step`, the two in a row.  All three pass the same
arguments: the `Rule` (the policy and what is static about the layer), the state, the
`Router` output, the layer's `Prediction` (speculative prefetch) and a PRNG key
(control rules).  The speculative decision is the rule's `speculate` function (the
prefetch package's, passed in: this package sits below it).

Batched (B tokens of one layer in lockstep, the `Router` fields [B, ...], `valid_B` the
active tokens): one step, whose decision is `policy.decide`'s per (token, expert) with
the waited experts the batch's union, each fetched once; the fetch insert protects every
expert any token executes; usage and admission add over the tokens (docs/design.md).
B = 1 is the engine's token, the same code.  Counts: `counting` (`step_counts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from moejax.cache import controls
from moejax.cache.counting import (PF_STATS, STATS, Record, counts, layer_counts,  # noqa: F401
                                   pf_stats, record, record_counts, row_counts, step_counts)
from moejax.cache import policy as policy_lib
from moejax.cache import resident as resident_lib
from moejax.cache.policy import FETCH, FETCH_LOW
from moejax.kernels import cpu_rows
from moejax.model import routing
from moejax.model.config import ModelConfig

_dataclass = lambda cls: jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@dataclasses.dataclass(frozen=True)
class Rule:
  """What a layer's step runs: the policy's parts and the layer's static facts.
  decision, cache: `DecideParams`, `CacheParams` (the simulator passes copies with traced
  numbers).  control: a `controls.Control` rule instead of `policy.decide`.
  speculate(true [1, E'], predicted [1, E'], view) -> Decision: the speculative decision
  (`prefetch.steps.speculative_decision`); None: no speculative prefetch.  keep: executed
  prefetches enter the cache (False: streaming).  skip_empty: inserts under a cond (the
  CPU backend).  all_resident: every expert resident for good (all hits)."""
  cfg: ModelConfig
  decision: Any
  cache: Any
  trim_to: int | None = None          # budget slots S when there are staging slots
  keep: bool = True
  control: Any = None
  speculate: Callable | None = None
  skip_empty: bool = False
  all_resident: bool = False

  @property
  def spec_on(self) -> bool:
    return self.speculate is not None


@_dataclass
class Router:
  """A MoE layer's router output for one token, or [B, ...] for a batch (`route`)."""
  logits_1xE: jax.Array    # the router logits [1, E'] (the simulator: the rank scores)
  ids_1xK: jax.Array       # the routed experts, by score
  gates_1xK: jax.Array     # their gates
  scores_1xE: jax.Array    # `routing.rank_scores` (substitutes are ranked by them)


def route(cfg: ModelConfig, logits_1xE) -> Router:
  r = policy_lib.route_once(cfg, logits_1xE)
  return Router(logits_1xE=logits_1xE, ids_1xK=r.ids, gates_1xK=r.gates,
                scores_1xE=r.rank_scores)


@_dataclass
class Prediction:
  """Router logits [1, E'] and whether there are any: a layer's predicted routing
  (speculative prefetch), or its true routing at the previous token."""
  logits_1xE: jax.Array
  has: jax.Array

  @classmethod
  def none(cls, cfg: ModelConfig) -> "Prediction":
    return cls(jnp.zeros((1, routing.router_width(cfg)), jnp.float32), jnp.bool_(False))


@_dataclass
class Pending:
  """What a layer's tail leaves for its next token: the admissions inserted (their rows
  are copied before the layer's experts run) and the executed prefetches kept."""
  admissions: jax.Array          # [K] admissions inserted (-1: none)
  admission_slots: jax.Array     # [K] their slots (-1: nothing to copy)
  admission_evicted: jax.Array   # [K] evicted by their insert
  kept: jax.Array                # [K] executed prefetches kept in the cache (-1: none)
  kept_slots: jax.Array          # [K] their slots

  @classmethod
  def none(cls, k: int) -> "Pending":
    """Nothing pending (five arrays: a donated carry must not hold one buffer twice)."""
    return cls(*(jnp.full((k,), -1, jnp.int32) for _ in range(5)))


@_dataclass
class Head:
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
  pf_stats: jax.Array      # [len(PF_STATS)] prefetch counts, columns named by PF_STATS


@_dataclass
class Step:
  """What one MoE layer of one token decided and did (`policy_step`)."""
  head: Head
  evicted: jax.Array       # [K (+K) + P] evicted by this token's inserts and trim
  pending: Pending         # for the next token

  @property
  def dec(self) -> policy_lib.Decision:
    return self.head.dec


# ------------------------------------------------------------------ helpers
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


def view(state: resident_lib.ResidentState, pf_ids_R: jax.Array) -> resident_lib.ResidentState:
  """The state the policy sees under speculative prefetch: prefetched expert j
  (pf_ids_R[j] >= 0, not in a slot) resident at table row P + 1 + j (the slot buffers,
  the scratch row, then the prefetch rows)."""
  num_e, num_p = state.expert_slot.shape[0], state.slot_expert.shape[0]
  pf = jnp.where(pf_ids_R >= 0, pf_ids_R, num_e)
  row = num_p + 1 + jnp.arange(pf_ids_R.shape[0], dtype=jnp.int32)
  free = state.expert_slot[jnp.minimum(pf, num_e - 1)] < 0
  slot = state.expert_slot.at[jnp.where(free, pf, num_e)].set(row, mode="drop")
  return dataclasses.replace(state, expert_slot=slot)


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
  # the slot buffers stay out of the cond (the insert reads only the metadata): as its
  # operand a buffer would come out a new array, not one layer of the scan's stack
  bufs = state.buffers
  none = jnp.full(ids.shape, -1, jnp.int32)
  new, ev, slots = jax.lax.cond(jnp.any(ids >= 0), run, lambda st: (st, none, none),
                                dataclasses.replace(state, buffers={}))
  return dataclasses.replace(new, buffers=bufs), ev, slots


# ------------------------------------------------------------------ the step
def _decide(rule: Rule, state, router: Router, key, valid_B) -> policy_lib.Decision:
  if rule.control is not None:
    return controls.decide(rule.control, router.logits_1xE, state, rule.decision, rule.cfg, key)
  return policy_lib.decide(router.logits_1xE, state, rule.decision, rule.cfg,
                           policy_lib.Routing(ids=router.ids_1xK, gates=router.gates_1xK,
                                              rank_scores=router.scores_1xE), valid_B)


def _flat(a):
  """[B, K] -> [B K]: a batched step's per-(token, expert) ids, tokens in order."""
  return a.reshape(-1)


def policy_head(rule: Rule, state, router: Router, prediction: Prediction, key, valid_B=None):
  """Steps 1-2 (module docstring): the decision and the fetch inserts -> (state, Head):
  what the layer's experts need; `policy_tail` finishes the step.  With
  `rule.all_resident` `decide` can only answer HIT and nothing is inserted: the decision
  is the routing.  prediction is read with `rule.speculate` only.  A router of B tokens
  ([B, ...] fields; valid_B: the active ones) is one batched step (`policy.decide`):
  Head's per-expert fields are [B K], each fetched expert in them once."""
  cfg = rule.cfg
  num_e, k = cfg.num_experts, cfg.top_k
  nb = router.ids_1xK.shape[0]
  if (nb > 1 or valid_B is not None) and (rule.spec_on or rule.control is not None):
    raise ValueError(f"a batched step ({nb} tokens) supports neither speculative prefetch "
                     "nor control rules")
  none_K = jnp.full((nb * k,), -1, jnp.int32)
  if rule.all_resident and not rule.spec_on and rule.control is None:
    dec = policy_lib.all_hits(router.logits_1xE, state, cfg)
    if valid_B is not None:
      on = jnp.asarray(valid_B, bool)[:, None]
      dec = dataclasses.replace(dec, ids=jnp.where(on, dec.ids, -1),
                                action=jnp.where(on, dec.action, -1),
                                exec_ids=jnp.where(on, dec.exec_ids, -1))
    rows = jnp.where(_flat(dec.exec_ids) >= 0, state.expert_slot[_flat(dec.ids)], -1)
    return state, Head(dec=dec, fetched=none_K, fetch_slots=none_K,
                       fetch_low=jnp.zeros((nb * k,), bool), rows=rows.astype(jnp.int32),
                       pf_ids=none_K, predicted=none_K, true_ids=_flat(dec.ids), evicted=none_K,
                       pf_stats=jnp.zeros((len(PF_STATS),), jnp.float32))
  pf_ids = predicted = none_K
  pf_counts = jnp.zeros((len(PF_STATS),), jnp.float32)
  seen = state
  if not rule.spec_on:
    dec = _decide(rule, state, router, key, valid_B)
    true_ids = _flat(dec.ids)
  else:
    pred, has = prediction.logits_1xE, prediction.has
    pred_ids = routing.route(cfg, pred).ids[0]            # [K] of the one token
    predicted = jnp.where(has, pred_ids, -1).astype(jnp.int32)
    pf_ids = jnp.where(has & (state.expert_slot[pred_ids] < 0), pred_ids, -1).astype(jnp.int32)
    dec_spec = rule.speculate(router.logits_1xE, pred, view(state, pf_ids))
    dec = jax.tree_util.tree_map(lambda a, b: jnp.where(has, a, b), dec_spec,
                                 _decide(rule, state, router, key, None))
    true_ids = router.ids_1xK[0]
    used = jnp.any(pf_ids[:, None] == dec.exec_ids[0][None, :], axis=1) & (pf_ids >= 0)
    hits = jnp.sum(jnp.any(pred_ids[:, None] == true_ids[None, :], axis=1))
    pf_counts = pf_stats(prefetches=jnp.sum(pf_ids >= 0), useful_prefetches=jnp.sum(used),
                         recall_hits=jnp.where(has, hits, 0),
                         predicted_calls=jnp.where(has, k, 0))
  action, exec_ids = _flat(dec.action), _flat(dec.exec_ids)
  fetch_low = action == FETCH_LOW
  fetched = jnp.where((action == FETCH) | fetch_low, _flat(dec.ids), -1).astype(jnp.int32)
  state, ev_fetch, fetch_slots = _insert(state, fetched, _in_use(exec_ids, num_e),
                                         rule.cache, rule.skip_empty, fetch_low)
  # the row each executed expert is read from: its slot, or its prefetch row
  seen = view(state, pf_ids) if rule.spec_on else state
  rows = jnp.where(exec_ids >= 0, seen.expert_slot[jnp.maximum(exec_ids, 0)],
                   -1).astype(jnp.int32)
  return state, Head(dec=dec, fetched=fetched, fetch_slots=fetch_slots, fetch_low=fetch_low,
                     rows=rows, pf_ids=pf_ids, predicted=predicted,
                     true_ids=true_ids.astype(jnp.int32), evicted=ev_fetch, pf_stats=pf_counts)


def policy_tail(rule: Rule, state, head: Head):
  """Steps 3-6: usage, the executed prefetches into the cache, this token's admission
  requests inserted for the next token, then the trim -> (state, Step).  It touches
  only the layer's own state and nothing its experts read this token."""
  cfg, decision, cache = rule.cfg, rule.decision, rule.cache
  num_e = cfg.num_experts
  dec = head.dec
  k = dec.ids.shape[-2] * cfg.top_k    # a batch of B tokens: up to B K admissions
  none_K = jnp.full((k,), -1, jnp.int32)
  state = policy_lib.update_usage(state, dec, cache)
  kept = kept_slots = none_K
  evicted = [head.evicted]
  if rule.spec_on:
    ev_pf = none_K
    if rule.keep:
      kept = jnp.where(jnp.any(head.pf_ids[:, None] == _flat(dec.exec_ids)[None, :], axis=1),
                       head.pf_ids, -1)
      state, ev_pf, kept_slots = _insert(state, kept, _in_use(_flat(dec.exec_ids), num_e), cache,
                                         False)
    evicted.append(ev_pf)
  adm = ev_adm = adm_slots = none_K
  if decision.admission_beta is not None:   # in place before the layer's next decision
    adm = first_k(dec.admit, k)
    state, ev_adm, adm_slots = _insert(state, adm, jnp.zeros((num_e,), bool), cache, False)
    if decision.low:   # an admitted low-precision resident: full rows into its own slot
      e = jnp.maximum(adm, 0)
      up = (adm >= 0) & (state.expert_slot[e] >= 0) & state.low[e] & (adm_slots < 0)
      adm_slots = jnp.where(up, state.expert_slot[e], adm_slots)
      state = dataclasses.replace(state, low=state.low & ~_in_use(jnp.where(up, adm, -1), num_e))
  ev_trim = jnp.full(state.slot_expert.shape, -1, jnp.int32)
  if rule.trim_to is not None:   # staging slots hold the token in flight only; the trim
    # comes after the admissions (evicted last), so between tokens a layer holds at most S
    slot_s = jnp.arange(state.slot_expert.shape[0])
    prot = jnp.any((adm_slots[:, None] == slot_s[None, :]) & (adm_slots[:, None] >= 0), axis=0)
    state, ev_trim = resident_lib.trim(state, rule.trim_to, cache, prot)
    gone = (adm >= 0) & (state.expert_slot[jnp.maximum(adm, 0)] < 0)   # more than S admitted
    adm, adm_slots = jnp.where(gone, -1, adm), jnp.where(gone, -1, adm_slots)
  pending = Pending(admissions=adm, admission_slots=adm_slots, admission_evicted=ev_adm,
                    kept=kept, kept_slots=kept_slots)
  return state, Step(head=head, evicted=jnp.concatenate(evicted + [ev_trim]), pending=pending)


def policy_tails(rule: Rule, states_L, heads_L: Head):
  """`policy_tail` of every MoE layer at once, vmapped over their stacked states [L, ...]
  (slot buffers left out: the tail reads only the metadata) -> (states, steps).  With
  `rule.all_resident` nothing can change: no usage counts are kept (nothing is evicted)."""
  if rule.all_resident:
    none = lambda: jnp.full(heads_L.fetched.shape, -1, jnp.int32)
    ev = jnp.full(heads_L.fetched.shape[:1] + (rule.cfg.top_k + states_L.slot_expert.shape[-1],),
                  -1, jnp.int32)
    nothing = Pending(**{f.name: none() for f in dataclasses.fields(Pending)})
    return states_L, Step(head=heads_L, evicted=ev, pending=nothing)
  buffers = states_L.buffers
  meta = dataclasses.replace(states_L, buffers={})
  meta, steps = jax.vmap(lambda st, hd: policy_tail(rule, st, hd))(meta, heads_L)
  return dataclasses.replace(meta, buffers=buffers), steps


def policy_step(rule: Rule, state, router: Router, prediction: Prediction, key=None,
                valid_B=None):
  """The cache's side of one MoE layer (module docstring) -> (state, Step): `policy_head`
  then `policy_tail`; of B tokens sharing the layer's cache with a [B, ...] router."""
  state, head = policy_head(rule, state, router, prediction, key, valid_B)
  return policy_tail(rule, state, head)


def prefill_step(rule: Rule, state, ids_PxK, valid_P, decay_pow):
  """The cache's side of a prompt at one MoE layer -> (state, copy ids [E], their slots,
  evicted [E + P]): the union of the prompt's experts was available; the missing ones
  are inserted most used first (ties by id) in one insert that never evicts an expert
  the prompt hit; every expert the prompt selected counts as used now; the LFU count
  decays once per prompt token; then the trim back to the budget."""
  num_e = state.expert_slot.shape[0]
  k = ids_PxK.shape[-1]
  used_e = jnp.zeros((num_e,), jnp.float32).at[ids_PxK.reshape(-1)].add(jnp.repeat(valid_P, k))
  used = used_e > 0
  resident = state.expert_slot >= 0
  missing = used & ~resident
  order = jnp.lexsort((jnp.arange(num_e), -used_e, ~missing))
  ordered = jnp.where(missing[order], order, -1).astype(jnp.int32)
  before = state
  state, ev = resident_lib.insert(state, ordered, None, used & resident, rule.cache)
  slots = placed(before, state, ordered)
  state = dataclasses.replace(state, last_used=jnp.where(used, state.step, state.last_used),
                              freq=state.freq * decay_pow + used_e, step=state.step + 1)
  ev_trim = jnp.full((state.slot_expert.shape[0],), -1, jnp.int32)
  if rule.trim_to is not None:
    state, ev_trim = resident_lib.trim(state, rule.trim_to, rule.cache)
  return state, ordered, slots, jnp.concatenate([ev, ev_trim])
