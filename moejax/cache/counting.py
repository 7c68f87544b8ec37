"""What a per-layer step (`cache.step`) decided, as the host reads it and as counts.

`Record`: one MoE layer's step of one token (`record`; the engine packs it,
`offload.stats`).  `counts`: the `STATS` of a layer's decisions, the same numbers in
jnp (the emulator's scan, the simulator) and in numpy (the engine's records);
`step_counts`: those of a batched step (B tokens of one layer sharing one cache,
`cache.step`), summed over the batch's active tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.cache.policy import DROP, FETCH, FETCH_LOW, HIT, HOST, SUBSTITUTE

# per-layer counts of a decoded token (summed over MoE layers by the drivers)
STATS = ("expert_calls", "hits", "fetches", "substituted", "substituted_mass", "dropped",
         "dropped_mass", "host_calls", "admissions", "admitted", "evictions", "prefetches",
         "useful_prefetches", "recall_hits", "predicted_calls", "fetches_low", "low_mass",
         "first_substituted")
# the columns of a step's prefetch counts (`Record.pf_stats`, `cache.step.Head`): named
# where they are made (`pf_stats`) and where they are read (`counts`)
PF_STATS = ("prefetches", "useful_prefetches", "recall_hits", "predicted_calls")


def pf_stats(xp=jnp, **named):
  """The prefetch counts as one f32 array [..., len(PF_STATS)] (a Record field), from
  their values by name."""
  if set(named) != set(PF_STATS):
    raise ValueError(f"pf_stats takes {', '.join(PF_STATS)}; got {', '.join(sorted(named))}")
  return xp.stack([xp.asarray(named[n], xp.float32) for n in PF_STATS], axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Record:
  """One MoE layer's step as the host reads it (`record`; `stats.build_record`)."""
  ids: jax.Array             # [K] selected experts
  actions: jax.Array         # [K]
  substitutes: jax.Array     # [K]
  share: jax.Array           # [K] f32
  fetched: jax.Array         # [K]
  admitted: jax.Array        # [K] admissions inserted before this layer's decision
  admissions: jax.Array      # [K] admissions requested now
  prefetched: jax.Array      # [K]
  predicted: jax.Array       # [K]
  true_ids: jax.Array        # [K]
  evicted: jax.Array         # [K + K (+K) + P]: the admitted ones', then this step's
  pf_stats: jax.Array        # [len(PF_STATS)] f32, columns named by PF_STATS
  rows: jax.Array            # [K] buffer row of each executed expert
  admission_slots: jax.Array  # [K]


def record(step, admitted) -> Record:
  """A layer's `Record` from its step (`cache.step.Step`) and the pending admissions
  (`cache.step.Pending`) it consumed.  A batched step's per-token fields are its rows'
  [B, K] flattened, [B K] in row order (B = 1: the token's [K])."""
  h, d = step.head, step.dec
  flat = lambda a: a.reshape(a.shape[:-2] + (-1,))
  return Record(flat(d.ids), flat(d.action), flat(d.sub_ids), flat(d.share), h.fetched, admitted.admissions, step.pending.admissions,
                h.pf_ids, h.predicted, h.true_ids,
                jnp.concatenate([admitted.admission_evicted, step.evicted], axis=-1),
                h.pf_stats, h.rows, step.pending.admission_slots)


def counts(xp, action, share, admissions, admitted, evicted, pf_stats, valid=None):
  """The `STATS` of MoE layers (leading axes kept, the last reduced): the same numbers
  in jnp inside the emulator's scan and in numpy from the engine's records.
  admissions: ids requested now; admitted: ids inserted for this token (-1 padded).
  valid: [..., B] (a batched step: action, share [..., B, K]): the per-token counts are
  summed over the active tokens; admissions, evictions and pf_stats are the step's."""
  f32 = lambda a: xp.asarray(a, xp.float32)
  tok = (lambda a: a) if valid is None else (lambda a: xp.sum(a * f32(valid), axis=-1))
  n = lambda m: xp.sum(f32(m), axis=-1)
  sub, drop, low = f32(action == SUBSTITUTE), f32(action == DROP), f32(action == FETCH_LOW)
  k = xp.full(action.shape[:-1], action.shape[-1], xp.float32)
  named = dict(expert_calls=tok(k), hits=tok(n(action == HIT)), fetches=tok(n(action == FETCH)),
               substituted=tok(n(sub)), substituted_mass=tok(xp.sum(sub * share, axis=-1)),
               dropped=tok(n(drop)), dropped_mass=tok(xp.sum(drop * share, axis=-1)),
               host_calls=tok(n(action == HOST)), admissions=n(admissions >= 0),
               admitted=n(admitted >= 0), evictions=n(evicted >= 0),
               fetches_low=tok(xp.sum(low, axis=-1)), low_mass=tok(xp.sum(low * share, axis=-1)),
               first_substituted=tok(sub[..., 0] + drop[..., 0]),
               **{name: pf_stats[..., j] for j, name in enumerate(PF_STATS)})
  return xp.stack([named[s] for s in STATS], axis=-1)


def record_counts(xp, rec: Record):
  """`counts` of a layer's (or stacked layers') `Record`."""
  return counts(xp, rec.actions, rec.share, rec.admissions, rec.admitted, rec.evicted,
                rec.pf_stats)


PER_STEP = ("admissions", "admitted", "evictions", "prefetches", "useful_prefetches",
             "recall_hits", "predicted_calls")


def row_counts(xp, rec: Record, valid_B):
  """`counts` of a batched step's Record per row -> [..., B, len(STATS)]: each active
  row's own (token, expert) counts (the row that waited first for an expert has its
  FETCH); what is the step's (admissions, evictions, prefetch counts) shared equally by
  its active rows, so the rows sum to `counts` with valid; inactive rows count zero."""
  nb = valid_B.shape[-1]
  per = lambda a: a.reshape(a.shape[:-1] + (nb, -1))
  step = lambda a: xp.broadcast_to(a[..., None, :], a.shape[:-1] + (nb, a.shape[-1]))
  c = counts(xp, per(rec.actions), per(rec.share), step(rec.admissions), step(rec.admitted),
             step(rec.evicted), step(rec.pf_stats))
  on = xp.asarray(valid_B, xp.float32)
  shared = on / xp.maximum(xp.sum(on, axis=-1, keepdims=True), 1.0)
  is_step = xp.asarray([s in PER_STEP for s in STATS])
  return c * xp.where(is_step, shared[..., None], on[..., None])


def layer_counts(step, prev):
  """`counts` of one layer's step of one token (jnp): the admissions inserted for this
  token and their evictions come from the previous token's tail (`prev`)."""
  return record_counts(jnp, record(step, prev))


def step_counts(step, prev, valid_B=None):
  """`counts` of one layer's batched step (B tokens, `cache.step.policy_step` with a
  [B, ...] router), summed over its active tokens (valid_B; None: all): each fetched
  expert counts once (the token that waited first has the FETCH), the admissions,
  their evictions and the step's evictions once per step.  B = 1: `layer_counts`."""
  d = step.dec
  valid = jnp.ones(d.action.shape[:-1], bool) if valid_B is None else valid_B
  return counts(jnp, d.action, d.share, step.pending.admissions, prev.admissions,
                jnp.concatenate([prev.admission_evicted, step.evicted], axis=-1),
                step.head.pf_stats, valid)
