"""Replays router traces through the offload policy, without the model.

The per-(token, layer) step is the engine's, made of the same functions
(`moejax.offload.policy` and `moejax.offload.resident`), in the engine's order:

  1. insert the background admissions requested at this layer on the previous
     token (`resident.insert`, nothing protected; ids in increasing order, as the
     engine requests them);
  2. `policy.decide` on the layer's router output;
  3. insert the FETCH experts in router-score order, never evicting an expert
     this token computes (`resident.insert` with the token's executed experts
     protected);
  4. `policy.update_usage`;
  then the experts `decide` marked for admission are pending for step 1 of the
  next token.

A trace may start with a prompt (`prefill_tokens`): it is handled like the
engine's exact prefill (the union of the prompt's selected experts is made
available; the fetched ones the prompt used most are inserted).

One jitted `lax.scan` over tokens carries every layer's ResidentState (without
slot buffers), `vmap`ped over MoE layers (each layer has its own cache) and over
policy variants whose static fields (miss rule, substitution variant, eviction,
admission on/off) agree; their numeric fields (tau, beta, LFU decay) are traced
values.  Output per policy: totals per layer (hits, misses, sync fetches,
substitutions, substituted mass, ...) and, per (token, layer), the counts the
time model needs (`STEP_FIELDS`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax import routing
from moejax.config import ModelConfig
from moejax.offload import policy as policy_lib
from moejax.offload import resident as resident_lib
from moejax.offload.policy import DROP, FETCH, HIT, HOST, SUBSTITUTE, PolicyParams

# totals per policy and layer (float: masses are shares g / sum(selected g))
STAT_FIELDS = ("expert_calls", "hits", "misses", "fetches", "substituted", "substituted_mass",
               "dropped", "dropped_mass", "host_calls", "admissions", "admitted", "evictions")
# per (token, layer), int8: what the time model reads
STEP_FIELDS = ("fetches", "host_calls", "admissions", "device_calls")


@dataclasses.dataclass
class SimResult:
  """One policy's replay of a trace (decode tokens only; the prompt is separate)."""
  policy: PolicyParams
  slots: int
  tokens: int
  totals_LxF: np.ndarray             # [L, len(STAT_FIELDS)]
  steps_TxLxC: np.ndarray | None     # [T, L, len(STEP_FIELDS)] int8
  # detail=True: per (token, layer) "stats" [T, L, F], "resident" [T, L, P] (slot_expert
  # after the token), and the decisions: "ids", "action", "sub_ids" [T, L, K] and "admit"
  # [T, L, K] (experts requested in the background, increasing, -1 padded)
  detail: dict | None = None

  def total(self, name: str) -> float:
    return float(self.totals_LxF[:, STAT_FIELDS.index(name)].sum())

  def per_layer(self, name: str) -> np.ndarray:
    return self.totals_LxF[:, STAT_FIELDS.index(name)]

  def summary(self) -> dict:
    """Totals and per-token means, named like the engine's statistics."""
    n, nl = max(self.tokens, 1), self.totals_LxF.shape[0]
    calls = max(self.total("expert_calls"), 1.0)
    s = {"policy": self.policy.describe(), "tokens": self.tokens, "slots_per_layer": self.slots}
    s.update({f"{k}_per_token": self.total(k) / n for k in STAT_FIELDS})
    s["hit_rate"] = self.total("hits") / calls
    s["substituted_call_pct"] = 100.0 * self.total("substituted") / calls
    s["substituted_mass_per_token_layer"] = self.total("substituted_mass") / (n * nl)
    s["substituted_mass_per_token"] = self.total("substituted_mass") / n
    s["per_layer"] = {k: [float(v) for v in self.per_layer(k)] for k in STAT_FIELDS}
    return s


def static_key(p: PolicyParams) -> PolicyParams:
  """The fields that change the computation (policies sharing it share one compile):
  miss rule, substitution variant, admission on/off, eviction."""
  d = policy_lib.DecideParams(miss=p.miss, substitution=p.substitution,
                              admission_beta=None if p.admission_beta is None else 0.5)
  return PolicyParams(d, policy_lib.CacheParams(eviction=p.eviction))


def _dyn(p: PolicyParams) -> np.ndarray:
  return np.asarray([p.tau, p.admission_beta or 0.0, p.lfu_decay], np.float32)


def _traced(static: PolicyParams, dyn_3):
  """(DecideParams, CacheParams) of `static` with tau, beta and the LFU decay replaced
  by traced values (vmap over variants).  The parts validate concrete numbers in
  __post_init__; the variants were validated when they were built, so the copies
  bypass it."""
  d, c = copy.copy(static.decision), copy.copy(static.cache)
  object.__setattr__(d, "tau", dyn_3[0])
  if d.admission_beta is not None:
    object.__setattr__(d, "admission_beta", dyn_3[1])
  object.__setattr__(c, "lfu_decay", dyn_3[2])
  return d, c


# ------------------------------------------------------------------ one lane
def _decode_step(cfg: ModelConfig, static: PolicyParams, trim_to, state, pending_K, logits_R,
                 dyn_3):
  """One (token, layer) of one policy: the engine's order (module docstring)."""
  dparams, params = _traced(static, dyn_3)
  num_e, k = cfg.num_experts, cfg.top_k
  admitted = jnp.zeros((), jnp.float32)
  ev_adm = jnp.zeros((), jnp.float32)
  if static.admission_beta is not None:
    state, ev = resident_lib.insert(state, pending_K, {}, jnp.zeros((num_e,), bool), params)
    admitted = jnp.sum(pending_K >= 0).astype(jnp.float32)
    ev_adm = jnp.sum(ev >= 0).astype(jnp.float32)
  dec = policy_lib.decide(logits_R[None], state, dparams, cfg)
  act, ids, ex = dec.action[0], dec.ids[0], dec.exec_ids[0]
  fetch = jnp.where(act == FETCH, ids, -1)
  in_use = jnp.zeros((num_e + 1,), bool).at[jnp.where(ex >= 0, ex, num_e)].set(True)[:num_e]
  state, ev = resident_lib.insert(state, fetch, {}, in_use, params)
  state = policy_lib.update_usage(state, dec, params)
  ev_trim = jnp.zeros((), jnp.float32)
  if trim_to is not None:                  # staging slots: back within the budget S
    state, evt = resident_lib.trim(state, trim_to, params)
    ev_trim = jnp.sum(evt >= 0).astype(jnp.float32)
  pending = _first_k(dec.admit, k)

  share = dec.share[0]
  n = lambda a: jnp.sum(act == a).astype(jnp.float32)
  n_adm = jnp.sum(dec.admit).astype(jnp.float32)
  stats = jnp.stack([
      jnp.float32(k), n(HIT), k - n(HIT), n(FETCH), n(SUBSTITUTE),
      jnp.sum(jnp.where(act == SUBSTITUTE, share, 0.0)), n(DROP),
      jnp.sum(jnp.where(act == DROP, share, 0.0)), n(HOST), n_adm, admitted,
      ev_adm + jnp.sum(ev >= 0) + ev_trim])
  step = jnp.stack([n(FETCH), n(HOST), n_adm, jnp.sum(ex >= 0).astype(jnp.float32)])
  decisions = dict(ids=ids, action=act, sub_ids=dec.sub_ids[0], admit=pending)
  return state, pending, stats, step.astype(jnp.int8), decisions


def _first_k(mask_E, k: int):
  """The first k set positions of mask_E in increasing order, -1 padded (jnp.nonzero
  with a size is a sort on XLA CPU; this is k x E compares)."""
  rank = jnp.cumsum(mask_E) - 1
  hit = mask_E[None, :] & (rank[None, :] == jnp.arange(k)[:, None])
  return jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), -1).astype(jnp.int32)


def _prefill(cfg: ModelConfig, static: PolicyParams, trim_to, state, logits_PxR, dyn_3):
  """The engine's prefill of a P-token prompt for one layer (see module docstring)."""
  _, params = _traced(static, dyn_3)
  num_e = cfg.num_experts
  ids, _, _ = routing.route(cfg, logits_PxR)
  counts = jnp.zeros((num_e,), jnp.float32).at[ids.reshape(-1)].add(1.0)
  used = counts > 0
  resident = state.expert_slot >= 0
  missing = used & ~resident
  # most used first, ties by id; experts not missing sort last and are skipped (-1)
  order = jnp.lexsort((jnp.arange(num_e), -counts, (~missing).astype(jnp.int32)))
  cand = jnp.where(missing[order], order, -1).astype(jnp.int32)
  state, _ = resident_lib.insert(state, cand, {}, used & resident, params)
  p = logits_PxR.shape[0]
  state = dataclasses.replace(
      state, last_used=jnp.where(used, state.step, state.last_used),
      freq=state.freq * params.lfu_decay ** p + counts, step=state.step + 1)
  if trim_to is not None:
    state, _ = resident_lib.trim(state, trim_to, params)
  return state


# ------------------------------------------------------------------ jitted scans
@functools.partial(jax.jit, static_argnames=("cfg", "static", "trim_to", "detail"))
def _scan(cfg, static, trim_to, states, pending, totals, logits_TxLxR, dyn_Px3, detail=False):
  """States [P, L, ...]; logits shared by the P policies."""
  step_l = jax.vmap(functools.partial(_decode_step, cfg, static, trim_to),
                    in_axes=(0, 0, 0, None))
  step_pl = jax.vmap(step_l, in_axes=(0, 0, None, 0))

  def body(carry, logits_LxR):
    st, pend, tot = carry
    st, pend, stats, step, dec = step_pl(st, pend, logits_LxR.astype(jnp.float32), dyn_Px3)
    out = (step, dict(dec, stats=stats, resident=st.slot_expert)) if detail else (step,)
    return (st, pend, tot + stats), out

  (states, pending, totals), ys = jax.lax.scan(body, (states, pending, totals), logits_TxLxR)
  return states, pending, totals, ys


@functools.partial(jax.jit, static_argnames=("cfg", "static", "trim_to"))
def _prefill_all(cfg, static, trim_to, states, logits_PxLxR, dyn_Px3):
  f = jax.vmap(functools.partial(_prefill, cfg, static, trim_to), in_axes=(0, 1, None))
  return jax.vmap(f, in_axes=(0, None, 0))(states, logits_PxLxR.astype(jnp.float32), dyn_Px3)


@functools.partial(jax.jit, static_argnames=("num_experts", "num_slots", "params"))
def _initial_states(order_LxS, num_experts: int, num_slots: int,
                    params: policy_lib.CacheParams):
  """Empty caches filled with order_LxS[l] (-1: nothing), as the engine's `fill` does."""
  def one(order_S):
    st = resident_lib.init_state(num_experts, num_slots, {}, buffers=False)
    st, _ = resident_lib.insert(st, order_S, {}, jnp.zeros((num_experts,), bool), params)
    return st
  return jax.vmap(one)(order_LxS)


# ------------------------------------------------------------------ driver
def budget_slots(cfg: ModelConfig, cache_fraction: float) -> resident_lib.Budget:
  """The engine's budget for `cache_fraction` (expert bytes do not matter here)."""
  return resident_lib.make_budget(cfg.num_experts, cfg.top_k, 1, len(cfg.moe_layers),
                                  fraction=cache_fraction)


def profile_initial(logits_TxLxR, cfg: ModelConfig, slots: int) -> np.ndarray:
  """[L, S]: per layer the `slots` experts routed most often on these logits (the
  engine's initial="profile" contents for counts measured on the same stream)."""
  out = []
  for l in range(logits_TxLxR.shape[1]):
    ids, _, _ = jax.jit(routing.route, static_argnums=0)(cfg, jnp.asarray(logits_TxLxR[:, l],
                                                                          jnp.float32))
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)
    out.append(resident_lib.profile_order(counts)[:slots])
  return np.asarray(out, np.int32)


def simulate(cfg: ModelConfig, logits_TxLxR, policies, *, cache_fraction: float = 0.25,
             initial_LxS=None, prefill_tokens: int = 0, per_step: bool = True,
             detail: bool = False, chunk: int = 8192, progress=None) -> list[SimResult]:
  """Replays `logits_TxLxR` (router outputs of the MoE layers) under each policy.

  initial_LxS: the experts each layer's cache starts with (e.g. `profile_initial`),
  None = empty.  The first `prefill_tokens` tokens are a prompt (engine prefill);
  the rest are decoded one by one.  detail=True also keeps every decision,
  every step's statistics and every layer's resident set (for checks).  Policies are grouped by `static_key`; each
  group is one vmapped scan, in chunks of `chunk` tokens.
  """
  policies = [policy_lib.make_policy(p) if isinstance(p, str) else p for p in policies]
  logits = np.asarray(logits_TxLxR)
  nt, nl, _ = logits.shape
  if nl != len(cfg.moe_layers):
    raise ValueError(f"router logits have {nl} layers; the model has {len(cfg.moe_layers)} "
                     f"MoE layers")
  if not 0 <= prefill_tokens < nt:
    raise ValueError(f"prefill_tokens={prefill_tokens} must be in [0, {nt})")
  budget = budget_slots(cfg, cache_fraction)
  trim_to = budget.slots if budget.staging else None
  groups: dict[PolicyParams, list[int]] = {}
  for i, p in enumerate(policies):
    groups.setdefault(static_key(p), []).append(i)
  results: list[SimResult | None] = [None] * len(policies)
  for static, members in groups.items():
    dyn = jnp.asarray(np.stack([_dyn(policies[i]) for i in members]))
    npol = len(members)
    order = (np.full((nl, budget.physical), -1, np.int32) if initial_LxS is None else
             np.pad(np.asarray(initial_LxS, np.int32)[:, :budget.physical],
                    ((0, 0), (0, max(0, budget.physical - np.shape(initial_LxS)[1]))),
                    constant_values=-1))
    st = _initial_states(jnp.asarray(order), cfg.num_experts, budget.physical, static.cache)
    states = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (npol,) + a.shape), st)
    if prefill_tokens:
      states = _prefill_all(cfg, static, trim_to, states, jnp.asarray(logits[:prefill_tokens]),
                            dyn)
    pending = jnp.full((npol, nl, cfg.top_k), -1, jnp.int32)
    totals = jnp.zeros((npol, nl, len(STAT_FIELDS)), jnp.float32)
    steps, det = [], []
    for lo in range(prefill_tokens, nt, chunk):
      xs = jnp.asarray(logits[lo:min(nt, lo + chunk)])
      states, pending, totals, ys = _scan(cfg, static, trim_to, states, pending, totals, xs,
                                          dyn, detail=detail)
      if per_step:
        steps.append(np.asarray(ys[0]))
      if detail:
        det.append(jax.tree_util.tree_map(np.asarray, ys[1]))
      if progress is not None:
        progress(min(nt, lo + chunk) - lo)
    totals = np.asarray(totals)
    for j, i in enumerate(members):
      results[i] = SimResult(
          policy=policies[i], slots=budget.slots, tokens=nt - prefill_tokens,
          totals_LxF=totals[j],
          steps_TxLxC=np.concatenate([s[:, j] for s in steps]) if per_step else None,
          detail={k: np.concatenate([d[k][:, j] for d in det]) for k in det[0]}
          if detail else None)
  return results
