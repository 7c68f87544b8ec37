"""Replays router traces through the offload policy, without the model.

The per-(token, layer) step is the engine's and the emulator's own function,
`cache.step.policy_step` (decide, insert the FETCH experts, usage, insert the admissions
this token requested, then trim: the state the layer's next decision sees), on the
recorded routing, with the arguments the engine's layers pass; its counts are
`cache.step.layer_counts` (an admission and its evictions count at the next token,
where they take effect).

A trace may start with a prompt (`prefill_tokens`): `cache.step.prefill_step`, the
engine's exact prefill (the union of the prompt's selected experts is made
available; the fetched ones the prompt used most are inserted).

One jitted `lax.scan` over tokens carries every layer's ResidentState (without
slot buffers) and its `Step.pending`, `vmap`ped over MoE layers (each layer has its
own cache) and over policy variants whose static fields (miss rule, substitution
variant, eviction, admission on/off) agree; their numeric fields (tau, beta, LFU
decay) are traced values.  Routing does not depend on the policy: each chunk of the
trace is routed once (`policy.route_once`) and `decide` reads that.  With several CPU
devices (`_layer_slices`) the layers are split between them and the slices run
concurrently.  Output per policy: totals per layer (hits, misses, sync fetches,
substitutions, substituted mass, ...) and, per (token, layer), the counts the time model
needs (`STEP_FIELDS`).

Batched (`batch` = B > 1): the trace is cut into B equal consecutive streams, each with
its own prompt (the B prompts prefilled together, one `prefill_step`), decoded in
lockstep: one `policy_step` per layer per batch of B tokens, the layer's cache shared
(`policy.decide`: the waited experts are the batch's union, each fetched once).
`STEP_FIELDS` are then per (step, layer): fetches of distinct experts, and
`device_calls` the distinct experts executed (the time model's compute).
"""

from __future__ import annotations

from concurrent import futures
import copy
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.cache import policy as policy_lib
from moejax.cache import initial as initial_lib
from moejax.cache import resident as resident_lib
from moejax.cache import step as step_lib
from moejax.cache.policy import PolicyParams
from moejax.io import staging

# totals per policy and layer (float: masses are shares g / sum(selected g))
STAT_FIELDS = ("expert_calls", "hits", "misses", "fetches", "substituted", "substituted_mass",
               "dropped", "dropped_mass", "host_calls", "admissions", "admitted", "evictions",
               "fetches_low", "low_mass")
# per (token, layer), int8: what the time model reads (fetches: full precision)
STEP_FIELDS = ("fetches", "host_calls", "admissions", "device_calls", "fetches_low")


@dataclasses.dataclass
class SimResult:
  """One policy's replay of a trace (decode tokens only; the prompt is separate)."""
  policy: PolicyParams
  slots: int
  tokens: int
  totals_LxF: np.ndarray             # [L, len(STAT_FIELDS)]
  steps_TxLxC: np.ndarray | None     # [T, L, len(STEP_FIELDS)] int8
  batch: int = 1                     # tokens per step (steps_TxLxC: per step)
  # detail=True: per (token, layer) "stats" [T, L, F], "resident" [T, L, P] (slot_expert
  # after the token, its admission requests inserted), and the decisions: "ids", "action",
  # "sub_ids" [T, L, K] and "admit" [T, L, K] (experts requested in the background,
  # increasing, -1 padded)
  detail: dict | None = None

  def total(self, name: str) -> float:
    return float(self.totals_LxF[:, STAT_FIELDS.index(name)].sum())

  def per_layer(self, name: str) -> np.ndarray:
    return self.totals_LxF[:, STAT_FIELDS.index(name)]

  def summary(self) -> dict:
    """Totals and per-token means, named like the engine's statistics."""
    n, nl = max(self.tokens, 1), self.totals_LxF.shape[0]
    calls = max(self.total("expert_calls"), 1.0)
    s = {"policy": self.policy.describe(), "tokens": self.tokens, "slots_per_layer": self.slots,
         "batch": self.batch}
    s.update({f"{k}_per_token": self.total(k) / n for k in STAT_FIELDS})
    s["hit_rate"] = self.total("hits") / calls
    s["substituted_call_pct"] = 100.0 * self.total("substituted") / calls
    s["substituted_mass_per_token_layer"] = self.total("substituted_mass") / (n * nl)
    s["substituted_mass_per_token"] = self.total("substituted_mass") / n
    s["fetches_per_step"] = self.total("fetches") * self.batch / n
    s["per_layer"] = {k: [float(v) for v in self.per_layer(k)] for k in STAT_FIELDS}
    return s

  def staging_hit_rate(self, rows: int, num_experts: int, decay: float = 0.999) -> float:
    """The share of the decode's full-precision copies (waited fetches, then background
    admissions, per token and layer) that a host staging tier of `rows` experts
    (`io.staging`, --host_cache_gb) would have served; needs detail=True.  The prompt's
    reads are not in a replay (the engine's counts include them)."""
    d = self.detail
    fetched = np.where(d["action"] == policy_lib.FETCH, d["ids"], -1)
    both = np.concatenate([fetched, np.asarray(d["admit"])], axis=-1)       # [T, L, 2K]
    layer = np.arange(both.shape[1])[None, :, None]
    keys = (layer * num_experts + both)[both >= 0]     # in (token, layer, fetch/admit) order
    hits, n = staging.replay(keys, rows, both.shape[1] * num_experts, decay)
    return hits / n if n else 0.0


def static_key(p: PolicyParams) -> PolicyParams:
  """The fields that change the computation (policies sharing it share one compile):
  miss rule, substitution variant, admission on/off, eviction, the low precision and
  the cost model (tau, tau_low, beta, lam and the LFU decay are traced)."""
  d = policy_lib.DecideParams(miss=p.miss, substitution=p.substitution,
                              admission_beta=None if p.admission_beta is None else 0.5,
                              low_bits=p.decision.low_bits,
                              cost=p.decision.cost_model() if p.miss == "cost" else None)
  return PolicyParams(d, policy_lib.CacheParams(eviction=p.eviction))


def _dyn(p: PolicyParams) -> np.ndarray:
  return np.asarray([p.tau, p.admission_beta or 0.0, p.lfu_decay, p.decision.tau_low,
                     p.decision.lam], np.float32)


def _traced(cfg: ModelConfig, static: PolicyParams, trim_to, dyn_3) -> step_lib.Rule:
  """The layer step's `Rule` of `static` with tau, beta, the LFU decay, tau_low and lam
  replaced by traced values (vmap over variants).  The parts validate concrete numbers in
  __post_init__; the variants were validated when they were built, so the copies
  bypass it."""
  d, c = copy.copy(static.decision), copy.copy(static.cache)
  object.__setattr__(d, "tau", dyn_3[0])
  if d.admission_beta is not None:
    object.__setattr__(d, "admission_beta", dyn_3[1])
  object.__setattr__(c, "lfu_decay", dyn_3[2])
  object.__setattr__(d, "tau_low", dyn_3[3])
  object.__setattr__(d, "lam", dyn_3[4])
  return step_lib.Rule(cfg=cfg, decision=d, cache=c, trim_to=trim_to)


_DECISIONS = ("ids", "action", "sub_ids")

# ------------------------------------------------------------------ one lane
# STAT_FIELDS from `step.STATS` (misses: the calls that were not hits)
_FROM_STATS = tuple(step_lib.STATS.index("expert_calls" if f == "misses" else f)
                    for f in STAT_FIELDS)


def _decode_step(cfg: ModelConfig, static: PolicyParams, trim_to, state, prev_pending,
                 routed, dyn_3):
  """One (step, layer) of one policy: `cache.step.policy_step` on B tokens.  prev_pending:
  the layer's `Step.pending` at the previous step (its admissions, inserted at that
  step's end, are counted here, where they take effect).  routed: the layer's
  `policy.Routing` (ids [B, K], gates [B, K], rank scores [B, E]) for this step
  (`policy.route_once`, once per trace); the rank scores stand in for the router logits
  (no control rule, no prefetch reads them)."""
  rule = _traced(cfg, static, trim_to, dyn_3)
  router = step_lib.Router(logits_1xE=routed.rank_scores, ids_1xK=routed.ids,
                           gates_1xK=routed.gates, scores_1xE=routed.rank_scores)
  state, step = step_lib.policy_step(rule, state, router, step_lib.Prediction.none(cfg), None)
  c = step_lib.step_counts(step, prev_pending)
  stats = c[jnp.asarray(_FROM_STATS)]
  stats = stats.at[STAT_FIELDS.index("misses")].add(-c[step_lib.STATS.index("hits")])
  n = lambda f: c[step_lib.STATS.index(f)]
  dec = step.dec
  executed = jnp.any(dec.exec_ids.reshape(-1, 1) == jnp.arange(cfg.num_experts), axis=0)
  steps = jnp.stack([n("fetches"), n("host_calls"), n("admissions"),
                     jnp.sum(executed).astype(jnp.float32), n("fetches_low")])
  decisions = dict(ids=dec.ids, action=dec.action, sub_ids=dec.sub_ids,
                   admit=step.pending.admissions)
  small = routed.ids.size <= 127          # int8 counts up to B K experts
  return state, step.pending, stats, steps.astype(jnp.int8 if small else jnp.int16), decisions


def _prefill(cfg: ModelConfig, static: PolicyParams, trim_to, state, logits_PxR, dyn_3,
             decay_pow):
  """A P-token prompt at one layer: `cache.step.prefill_step` on its routing."""
  rule = _traced(cfg, static, trim_to, dyn_3)
  ids = routing.route(cfg, logits_PxR).ids
  valid = jnp.ones((logits_PxR.shape[0],), jnp.float32)
  state, _copy_ids, _copy_slots, _evicted = step_lib.prefill_step(rule, state, ids, valid,
                                                                  decay_pow)
  return state


# ------------------------------------------------------------------ jitted scans
@functools.partial(jax.jit, static_argnames=("cfg", "static", "trim_to", "detail"))
def _scan(cfg, static, trim_to, states, pending, totals, logits_TxLxBxR, dyn_Px3, detail=False):
  """States [P, L, ...]; logits [steps, L, B, R] shared by the P policies, routed once for
  all of them (routing does not depend on the policy)."""
  step_l = jax.vmap(functools.partial(_decode_step, cfg, static, trim_to),
                    in_axes=(0, 0, 0, None))
  step_pl = jax.vmap(step_l, in_axes=(0, 0, None, 0))

  def body(carry, routed_L):
    st, pend, tot = carry
    st, pend, stats, step, dec = step_pl(st, pend, routed_L, dyn_Px3)
    out = (step, dict(dec, stats=stats, resident=st.slot_expert)) if detail else (step,)
    return (st, pend, tot + stats), out

  routed = policy_lib.route_once(cfg, logits_TxLxBxR.astype(jnp.float32))
  (states, pending, totals), ys = jax.lax.scan(body, (states, pending, totals), routed)
  return states, pending, totals, ys


@functools.partial(jax.jit, static_argnames=("cfg", "static", "trim_to"))
def _prefill_all(cfg, static, trim_to, states, logits_PxLxR, dyn_Px3, decay_P):
  f = jax.vmap(functools.partial(_prefill, cfg, static, trim_to), in_axes=(0, 1, None, None))
  return jax.vmap(f, in_axes=(0, None, 0, 0))(states, logits_PxLxR.astype(jnp.float32),
                                              dyn_Px3, decay_P)


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
def budget_slots(cfg: ModelConfig, cache_fraction: float,
                 devices: int = 1) -> resident_lib.Budget:
  """The engine's budget for `cache_fraction` (expert bytes do not matter here); with
  devices > 1 the fraction is per device and the slots their union (expert-parallel)."""
  return resident_lib.make_budget(cfg.num_experts, cfg.top_k, 1, len(cfg.moe_layers),
                                  fraction=cache_fraction, devices=devices)


def profile_initial(logits_TxLxR, cfg: ModelConfig, slots: int) -> np.ndarray:
  """[L, S]: per layer the `slots` experts routed most often on these logits (the
  engine's initial="profile" contents for counts measured on the same stream)."""
  out = []
  for l in range(logits_TxLxR.shape[1]):
    ids, _, _ = jax.jit(routing.route, static_argnums=0)(cfg, jnp.asarray(logits_TxLxR[:, l],
                                                                          jnp.float32))
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)
    out.append(initial_lib.profile_order(counts)[:slots])
  return np.asarray(out, np.int32)


def _layer_slices(nl: int):
  """(device, (first layer, end)) per slice: the layers split evenly over the local CPU
  devices (one slice elsewhere).  A process sees several CPU devices with
  XLA_FLAGS=--xla_force_host_platform_device_count=N (the checkout's bench_simulator sets it to
  the core count); each device runs its slice's scan on its own thread."""
  devs = jax.local_devices()
  if devs[0].platform != "cpu":
    devs = devs[:1]
  parts = np.array_split(np.arange(nl), min(len(devs), nl))
  return [(d, (int(p[0]), int(p[-1]) + 1)) for d, p in zip(devs, parts)]


@dataclasses.dataclass(frozen=True)
class SimOptions:
  """How `simulate` replays a trace, and what it keeps.

  cache_fraction, devices: each layer's cache (`budget_slots`: `devices` expert-parallel
  devices of `cache_fraction` each; their union is one cache, the engine's
  `expert_parallel` design).  initial_LxS: the experts each layer's cache starts with
  (e.g. `profile_initial`), None = empty.  prefill_tokens: the first tokens are a prompt
  (engine prefill); the rest are decoded one by one.  batch = B > 1: B equal consecutive
  streams of the trace (the rest dropped), each with a prompt of `prefill_tokens`,
  decoded in lockstep sharing each layer's cache (module docstring).
  per_step: keep the per-(token, layer) counts (`SimResult.steps_TxLxC`; per step when
  batched).  detail: also every decision (batched: [steps, L, B, K]), every step's
  statistics and every layer's resident set (for checks).  chunk: tokens per scan call.
  progress: called with the number of tokens done after each chunk.
  """
  cache_fraction: float = 0.25
  devices: int = 1
  initial_LxS: Any = None
  prefill_tokens: int = 0
  batch: int = 1
  per_step: bool = True
  detail: bool = False
  chunk: int = 8192
  progress: Callable[[int], None] | None = None


def simulate(cfg: ModelConfig, logits_TxLxR, policies, options: SimOptions | None = None,
             **fields) -> list[SimResult]:
  """Replays `logits_TxLxR` (router outputs of the MoE layers) under each policy (names or
  PolicyParams), as `options` say (`SimOptions`; its fields may also be given as keywords:
  `simulate(cfg, logits, ["quality"], cache_fraction=0.5)`).  Policies are grouped by
  `static_key`; each group is one vmapped scan per slice of layers (`_layer_slices`), in
  chunks of `options.chunk` tokens.
  """
  o = dataclasses.replace(options or SimOptions(), **fields)
  policies = [policy_lib.make_policy(p) if isinstance(p, str) else p for p in policies]
  streams = _streams(cfg, np.asarray(logits_TxLxR), o)
  budget = budget_slots(cfg, o.cache_fraction, o.devices)
  groups: dict[PolicyParams, list[int]] = {}
  for i, p in enumerate(policies):
    groups.setdefault(static_key(p), []).append(i)
  results: list[SimResult | None] = [None] * len(policies)
  for static, members in groups.items():
    group = [policies[i] for i in members]
    totals, steps, det = _replay_group(cfg, static, group, streams, budget, o)
    steps_n = streams.shape[1] - o.prefill_tokens
    for j, i in enumerate(members):
      one = (lambda a: a[:, :, 0]) if o.batch == 1 else (lambda a: a)   # decisions [.., K]
      results[i] = SimResult(
          policy=policies[i], slots=budget.slots, tokens=steps_n * o.batch,
          totals_LxF=totals[j],
          steps_TxLxC=np.concatenate([s[:, j] for s in steps]) if o.per_step else None,
          batch=o.batch,
          detail={k: one(np.concatenate([d[k][:, j] for d in det])) if k in _DECISIONS
                  else np.concatenate([d[k][:, j] for d in det]) for k in det[0]}
          if o.detail else None)
  return results


def _streams(cfg: ModelConfig, logits, o: SimOptions) -> np.ndarray:
  """[B, tokens per stream, L, R]: the trace cut into `o.batch` equal streams, after
  checking it against the model and the options (ValueError naming the value)."""
  nt, nl, _ = logits.shape
  if nl != len(cfg.moe_layers):
    raise ValueError(f"router logits have {nl} layers; the model has {len(cfg.moe_layers)} "
                     f"MoE layers")
  if o.batch < 1:
    raise ValueError(f"batch={o.batch} must be >= 1")
  seg = nt // o.batch                    # tokens per stream
  if not 0 <= o.prefill_tokens < seg:
    raise ValueError(f"prefill_tokens={o.prefill_tokens} must be in [0, {seg})"
                     + (f" ({nt} tokens in {o.batch} streams)" if o.batch > 1 else ""))
  return logits[:seg * o.batch].reshape((o.batch, seg) + logits.shape[1:])


def _start_states(cfg: ModelConfig, static: PolicyParams, group, streams, budget,
                  o: SimOptions, dyn):
  """Every layer's ResidentState for each policy of the group: the initial contents, then
  the streams' prompts prefilled (the LFU decay over the prompt as the engine's)."""
  nl, npol = streams.shape[2], len(group)
  order = (np.full((nl, budget.physical), -1, np.int32) if o.initial_LxS is None else
           np.pad(np.asarray(o.initial_LxS, np.int32)[:, :budget.physical],
                  ((0, 0), (0, max(0, budget.physical - np.shape(o.initial_LxS)[1]))),
                  constant_values=-1))
  st = _initial_states(jnp.asarray(order), cfg.num_experts, budget.physical, static.cache)
  states = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (npol,) + a.shape), st)
  if o.prefill_tokens:   # the LFU decay over the prompt, rounded from f64 as the engine's
    decay = np.asarray([np.float32(float(p.lfu_decay) ** np.float64(o.prefill_tokens))
                        for p in group])
    prompts = streams[:, :o.prefill_tokens].reshape((-1,) + streams.shape[2:])
    states = _prefill_all(cfg, static, budget.slots if budget.staging else None, states,
                          jnp.asarray(prompts), dyn, jnp.asarray(decay))
  return states


def _replay_group(cfg: ModelConfig, static: PolicyParams, group, streams, budget,
                  o: SimOptions):
  """(totals [P, L, F], per-step counts per chunk, details per chunk) of the policies of
  one `static_key` group over the streams' decode steps."""
  nl, npol = streams.shape[2], len(group)
  trim_to = budget.slots if budget.staging else None
  steps_n = streams.shape[1] - o.prefill_tokens       # decode steps
  dyn = jnp.asarray(np.stack([_dyn(p) for p in group]))
  states = _start_states(cfg, static, group, streams, budget, o, dyn)
  pending = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (npol, nl) + a.shape),
                                   step_lib.Pending.none(cfg.top_k * o.batch))
  totals = jnp.zeros((npol, nl, len(STAT_FIELDS)), jnp.float32)
  # layers are independent given the trace: one slice of them per CPU device, each
  # chunk of each slice run from its own thread, so the slices run at once
  shards = []
  for dev, (l0, l1) in _layer_slices(nl):
    put = lambda a, dev=dev, l0=l0, l1=l1: jax.device_put(a[:, l0:l1], dev)
    shards.append([dev, l0, l1, jax.tree_util.tree_map(put, (states, pending, totals)),
                   jax.device_put(dyn, dev)])
  steps, det = [], []

  def run(sh, lo):   # one slice's chunk, read back in its own thread (the GIL is released)
    dev, l0, l1, carry, dyn_d = sh
    xs = np.ascontiguousarray(   # [steps, L, B, R]
        streams[:, o.prefill_tokens + lo:o.prefill_tokens + min(steps_n, lo + o.chunk),
                l0:l1].transpose(1, 2, 0, 3))
    xs = jax.device_put(xs, dev)
    *carry, y = _scan(cfg, static, trim_to, *carry, xs, dyn_d, detail=o.detail)
    sh[3] = tuple(carry)
    return jax.tree_util.tree_map(np.asarray, y)

  pool = futures.ThreadPoolExecutor(len(shards)) if len(shards) > 1 else None
  for lo in range(0, steps_n, o.chunk):
    ys = ([run(shards[0], lo)] if pool is None else
          [f.result() for f in [pool.submit(run, sh, lo) for sh in shards]])
    # slices joined on L (axis 2)
    if o.per_step:
      steps.append(np.concatenate([y[0] for y in ys], axis=2))
    if o.detail:
      det.append({k: np.concatenate([y[1][k] for y in ys], axis=2) for k in ys[0][1]})
    if o.progress is not None:
      o.progress(o.batch * (min(steps_n, lo + o.chunk) - lo))
  if pool is not None:
    pool.shutdown()
  return np.concatenate([np.asarray(sh[3][2]) for sh in shards], axis=1), steps, det
