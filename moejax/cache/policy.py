"""Miss policies, eviction and background admission: one pure, jittable `decide`.

The same code serves the engine (real transfers), the emulator (exact outputs,
idealised transfers) and the simulator (recorded router logits, no model).

Per token, `decide` routes with the family's own rule (`moejax.model.routing.route`)
and gives every selected expert one *action*:

  HIT         resident: computed from its slot.
  FETCH       missed, the policy waits: fetched synchronously and inserted.
  SUBSTITUTE  missed, replaced by the resident expert with the highest router
              score (`routing.rank_scores`: the router logit or the family's
              pre-normalisation score, never an underflowing probability; ties
              by lowest id) that is not selected for this token and not already used as
              a substitute; computed with the missed expert's gate weight.
              Misses take substitutes in the order of their own router scores.
  HOST        missed, computed on the host CPU (`host` policy).
  FETCH_LOW   missed, the policy waits for its low-precision copy (int8 or int4,
              `io.quant`), dequantised into the slot; the slot is marked low
              (`ResidentState.low`) until an admission upgrades it (below).
  DROP        missed and skipped: the `drop` substitution variant (remaining
              weights renormalised to the selected experts' total weight), or a
              substitution for which no unused resident expert was left (no
              renormalisation).

Which misses wait: `fetch_all` every one; `threshold(tau)` the first choice and
every miss whose *normalised share* g / sum(selected g) is >= tau (a share equal
to tau waits; for routers that renormalise the share is g itself);
`first_choice` only the first choice; `substitute_all` and `host` none;
`fetch_low`, `threshold_low` and `cost` (lam): `moejax.cache.cost`.

Background admission(beta): every miss that is not waited for (substituted,
dropped or computed on the host) adds its normalised share g / sum(selected g)
(the quantity the threshold rule compares) to the missed expert's accumulator; when the accumulator reaches beta (>=) the expert is requested
asynchronously (``Decision.admit``) and its accumulator is reset to 0.  A selection
served in low precision (FETCH_LOW, or a HIT on a low slot) accumulates too; an
admitted expert resident in low precision is upgraded: its full-precision rows are
copied into its own slot (no eviction) where admissions are inserted, and the slot is
no longer low.  Without admission a low copy stays until it is evicted.

Eviction (lru, lfu, SpecMD's least_stale) orders the slots an insertion may overwrite:
`moejax.cache.eviction`.  The LFU count of expert e is updated here, once per step (a
token, or a batch of them) and layer (`update_usage`), as ``freq[e] <- lfu_decay * freq[e] + n_e``, n_e the number of
this step's tokens whose router selected e (hit, fetched, substituted, dropped or host
alike: it tracks demand); the default decay 0.98 is a half-life of about 34 tokens.

Parameters come in two hashable parts, so compile-cache keys follow from types:
`DecideParams` (read by `decide`) and `CacheParams` (read by `eviction.eviction_order`,
`update_usage` and `resident.insert`); `PolicyParams` holds both and a name.
Every function is pure and jittable (no Python-side state, no callbacks).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.cache import cost as cost_lib
from moejax.cache.policy_params import (  # noqa: F401  the parameters, re-exported
    CacheParams, DecideParams, EVICTIONS, MISS_RULES, PRESETS, PolicyError, PolicyParams,
    SUBSTITUTIONS, cache_params, decide_params, make_policy)
from moejax.kernels import cpu_rows
from moejax.model import routing
from moejax.model.config import ModelConfig

HIT, FETCH, SUBSTITUTE, HOST, DROP, FETCH_LOW = 0, 1, 2, 3, 4, 5



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decision:
  """The policy's decision for N tokens of one MoE layer (K selected experts each)."""
  ids: jax.Array        # [N,K] int32 routed experts, by router score (desc)
  gates: jax.Array      # [N,K] f32 the model's own gate weights
  share: jax.Array      # [N,K] f32 g / sum(selected g)
  action: jax.Array     # [N,K] int32 HIT/FETCH/SUBSTITUTE/HOST/DROP
  sub_ids: jax.Array    # [N,K] int32 the substitute (-1 unless SUBSTITUTE)
  exec_ids: jax.Array   # [N,K] int32 expert computed on the device (-1: none)
  weights: jax.Array    # [N,K] f32 weight applied to the executed (or host) expert
  admit: jax.Array      # [E] bool: request in the background now
  acc: jax.Array        # [E] f32 admission accumulator after this step


def prefix_count(mask):
  """The running count of a bool mask along its last axis, inclusive (int32): n x n
  compares in one fusion (XLA CPU runs a cumsum as a reduce-window of its own, ~10 us
  even for 64 entries)."""
  n = mask.shape[-1]
  tri = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]      # [i, j]: j <= i
  return jnp.sum(tri & mask[..., None, :], axis=-1, dtype=jnp.int32)


def pick(values, index):
  """values[..., index[..., j]] along the last axis by one-hot compares (no gather)."""
  hit = index[..., :, None] == jnp.arange(values.shape[-1])
  return jnp.sum(jnp.where(hit, values[..., None, :], jnp.zeros((), values.dtype)), axis=-1)


class Routing(NamedTuple):
  """What `decide` reads of the router logits [..., E], which no policy changes
  (`route_once`), read by field name."""
  ids: jax.Array           # [..., K] int32 the routed experts, by score (`routing.route`)
  gates: jax.Array         # [..., K] f32 their gates
  rank_scores: jax.Array   # [..., E] f32 what ranks substitutes (`routing.rank_scores`)


def route_once(cfg: ModelConfig, router_logits_NxE: jax.Array) -> Routing:
  """The `Routing` of router logits [..., E] (`routing.route`, `routing.rank_scores`)."""
  routed = routing.route(cfg, router_logits_NxE)
  return Routing(ids=routed.ids, gates=routed.gates,
                 rank_scores=routing.rank_scores(cfg, router_logits_NxE))


def _first_of(mask_NxK, ids_NxK):
  """[N, K]: set where mask is and no earlier set entry (row-major) holds the same id."""
  f = jnp.where(mask_NxK, ids_NxK, -1).reshape(-1)
  j = jnp.arange(f.shape[0])
  dup = jnp.any((f[:, None] == f[None, :]) & (j[None, :] < j[:, None]), axis=1)
  return mask_NxK & ~dup.reshape(mask_NxK.shape)


def _substitutes(ids_NxK, scores_NxE, rest_NxK, on_device_E):
  """(whether a substitute was found [N, K], its id [N, K]) for each miss in `rest`: the
  token's best-scored experts on the device this step (`on_device_E`: resident or fetched
  now) that it did not select, handed to its misses in score order (ties by lowest id)."""
  num_e, k = scores_NxE.shape[-1], ids_NxK.shape[-1]
  selected = jnp.any(ids_NxK[..., None] == jnp.arange(num_e), axis=-2)          # [N,E]
  cand_ok = on_device_E[None, :] & ~selected
  cand_score = jnp.where(cand_ok, scores_NxE, -jnp.inf)
  c_score, c_ids = cpu_rows.top_k(cand_score, k)                 # [N,K]
  rank = prefix_count(rest_NxK) - 1                              # misses in score order
  rank = jnp.clip(rank, 0, k - 1)
  got_sub = pick(jnp.where(c_score > -jnp.inf, 1, 0), rank) > 0
  return got_sub, pick(c_ids.astype(jnp.int32), rank)


def _admission(beta: float, acc_E, ids_NxK, share_NxK, counted_NxK):
  """(admit [E], accumulator [E]): the counted (token, expert) pairs' shares added per
  expert; an expert whose sum reaches `beta` is admitted and its sum restarts at 0."""
  num_e = acc_E.shape[0]
  w = jnp.where(counted_NxK, share_NxK, 0.0)
  acc = acc_E + cpu_rows.bin_sum(ids_NxK.reshape(1, -1), w.reshape(1, -1), num_e)[0]
  admit = acc >= beta
  return admit, jnp.where(admit, 0.0, acc)


def decide(router_logits_NxE: jax.Array, resident, params: DecideParams | PolicyParams,
           cfg: ModelConfig, routed: Routing | None = None, valid_N=None) -> Decision:
  """The policy's decision for every selected expert of N tokens of one layer, decoded
  together against one resident set (a batch; pure, jittable).

  `resident` is the layer's ResidentState (only `expert_slot`, `acc`, `low` are read).
  Each (token, expert) is decided by the rule on its own; the experts waited for are
  the union over the batch, each fetched once: FETCH (FETCH_LOW) for the first token
  (row-major) that waits for it, HIT for every other token that selected it, whatever
  its own rule would have done (a miss it would have substituted, dropped or computed
  on the host uses the real expert; a full fetch serves a token that wanted the low
  copy).  Substitutes are the best-ranked (`routing.rank_scores`, ties by lowest id)
  experts resident or fetched this step and not selected by the token.  The admission
  accumulator adds over the batch's tokens.  valid_N: [N] bool, inactive rows decide
  nothing (ids, exec_ids, sub_ids -1, action -1, weights 0).  N = 1 is the engine's token.
  routed: the `Routing` `route_once(cfg, router_logits_NxE)` computed beforehand (the
  simulator routes a trace once for all its policies; the logits are then not read).
  """
  params = decide_params(params)
  routed = route_once(cfg, router_logits_NxE) if routed is None else routed
  ids, gates, scores = routed.ids, routed.gates, routed.rank_scores
  n, k = ids.shape
  num_e = scores.shape[-1]
  total = jnp.sum(gates, axis=-1, keepdims=True)
  share = gates / jnp.where(total > 0, total, 1.0)
  is_res = resident.expert_slot[ids] >= 0
  miss = ~is_res
  first = jnp.arange(k)[None, :] == 0
  on = jnp.ones((n, 1), bool) if valid_N is None else jnp.asarray(valid_N, bool)[:, None]

  # FETCH, FETCH_LOW, HOST, DROP without a substitute (`cost.miss_masks`), per token
  wait, low, host, drop = cost_lib.miss_masks(params, miss & on, first, share)
  # the batch's fetches: each expert once, a full copy when any token waits for one
  full_E = jnp.any((jnp.where(wait, ids, -1).reshape(-1, 1) == jnp.arange(num_e)), axis=0)
  low_E = jnp.any((jnp.where(low, ids, -1).reshape(-1, 1) == jnp.arange(num_e)), axis=0)
  low_E = low_E & ~full_E
  got = miss & (full_E | low_E)[ids]                 # served by this step's fetches
  wait = _first_of(wait, ids)
  low = _first_of(low & ~full_E[ids], ids)
  batch_hit = got & ~wait & ~low                     # fetched for another token
  served_elsewhere = miss & ~got     # not in the cache this token
  host, drop = host & ~got, drop & ~got
  if params.miss == "host":
    host = served_elsewhere
  rest = served_elsewhere & ~host & ~drop    # substituted (or dropped per the variant)

  action = jnp.where(is_res | batch_hit, HIT, jnp.where(low, FETCH_LOW, FETCH))
  action = jnp.where(host, HOST, jnp.where(drop, DROP, action))
  sub_ids = jnp.full_like(ids, -1)
  weights = jnp.where(drop, 0.0, gates)
  if params.miss in ("host", "fetch_all", "fetch_low"):   # nothing to substitute
    pass
  elif params.substitution == "drop":
    action = jnp.where(rest, DROP, action)
    kept = jnp.where(rest, 0.0, weights)
    kept_total = jnp.sum(kept, axis=-1, keepdims=True)
    weights = jnp.where(kept_total > 0, kept * total / jnp.where(kept_total > 0, kept_total, 1.0),
                        0.0)
  else:
    got_sub, sub = _substitutes(ids, scores, rest, (resident.expert_slot >= 0) | full_E | low_E)
    do_sub = rest & got_sub
    action = jnp.where(do_sub, SUBSTITUTE, jnp.where(rest, DROP, action))
    sub_ids = jnp.where(do_sub, sub, -1)
    weights = jnp.where(rest & ~got_sub, 0.0, weights)
  action = action.astype(jnp.int32)
  exec_ids = jnp.where((action == HIT) | (action == FETCH) | (action == FETCH_LOW), ids,
                       jnp.where(action == SUBSTITUTE, sub_ids, -1)).astype(jnp.int32)

  acc = resident.acc
  admit = jnp.zeros((num_e,), bool)
  if params.admission_beta is not None:     # served elsewhere or in low precision
    low_hit = (is_res & resident.low[ids]) | (batch_hit & low_E[ids])
    admit, acc = _admission(params.admission_beta, acc, ids, share,
                            (served_elsewhere | low | low_hit) & on)
  if valid_N is not None:
    ids, action, sub_ids, exec_ids = (jnp.where(on, a, -1) for a in (ids, action, sub_ids,
                                                                      exec_ids))
    weights = jnp.where(on, weights, 0.0)
  return Decision(ids=ids, gates=gates, share=share, action=action, sub_ids=sub_ids,
                  exec_ids=exec_ids, weights=weights, admit=admit, acc=acc)


def all_hits(router_logits_NxE: jax.Array, resident, cfg: ModelConfig) -> Decision:
  """`decide`'s answer when every expert is resident for good (any policy): the
  routing, every action HIT, nothing admitted."""
  routed = routing.route(cfg, router_logits_NxE)
  ids, gates = routed.ids, routed.gates
  total = jnp.sum(gates, axis=-1, keepdims=True)
  share = gates / jnp.where(total > 0, total, 1.0)
  return Decision(ids=ids, gates=gates, share=share, action=jnp.zeros_like(ids),
                  sub_ids=jnp.full_like(ids, -1), exec_ids=ids, weights=gates,
                  admit=jnp.zeros(resident.acc.shape, bool), acc=resident.acc)


def update_usage(resident, decision: Decision, params: CacheParams | PolicyParams):
  """Usage statistics and admission accumulator after one step (pure).

  lru, least_stale: experts computed on the device this step get ``last_used = step``
  (insertions set it, and least_stale's ``loaded``, in `resident.insert`).
  lfu: ``freq <- lfu_decay * freq + (router selections this step)``.
  """
  params = cache_params(params)
  num_e = resident.expert_slot.shape[0]
  # one-hot compares, not scatters (XLA CPU runs a scatter as a loop of its own; counts
  # are sums of ones, exact in any order)
  e_E = jnp.arange(num_e, dtype=jnp.int32)
  used = jnp.any(decision.exec_ids.reshape(-1, 1) == e_E, axis=0)
  counts = jnp.sum((decision.ids.reshape(-1, 1) == e_E).astype(jnp.float32), axis=0)
  return dataclasses.replace(
      resident,
      last_used=jnp.where(used, resident.step, resident.last_used),
      freq=resident.freq * params.lfu_decay + counts,
      acc=decision.acc,
      step=resident.step + 1)
