"""Auto-tuning a miss policy to a quality or latency budget, and the Pareto frontier.

Pure functions over a *sweep*: every policy of a grid of `PolicyParams` replayed by
the simulator (`moejax.research.simulator`) on a calibration trace, each point with

  mass     substituted + dropped gate mass per token and MoE layer (the quality
           proxy: the quality study found the perplexity increase tracks it, r=0.88);
  bytes    sync-fetched ("waited") bytes per token, counted in bf16;
  ms       projected time per token per hardware profile (`timemodel`, the trace's
           per-layer counts tiled over the target shape's MoE layers).

The proxy is turned into a predicted perplexity increase by a `QualityFit`
(`quality_fit`) calibrated on emulated points (`emulator`: exact teacher-forced perplexity under
the policy): a monotone (isotonic) piecewise-linear curve through (0, 0) and the
measured (mass, dPPL) pairs, extrapolated with its last segment's slope.

`tune` picks the fastest point predicted within a perplexity budget (or the best
quality within a time budget), measures it with the emulator (a callback), refits
with the new measurement and repeats; the answer is the best point whose
*measured* increase meets the budget.  Knobs: tau and admission beta of the
threshold family, the eviction rule, and lambda of the `cost` rule when the policy
module has it (`cost_available`).
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

from moejax.cache import policy as policy_lib
from moejax.cache.policy import PolicyParams
from moejax.offload import hardware
from moejax.research import simulator, timemodel
from moejax.research.quality_fit import QualityFit, fit_quality

TAUS = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5)
TAUS_FULL = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.085, 0.1, 0.12, 0.15,
             0.2, 0.25, 0.3, 0.4, 0.5)
LAMS = tuple(float(f"{v:.3g}") for v in np.geomspace(0.03, 1000.0, 13))   # ms per % PPL
# (eviction, admission beta) pairs: the seed's two (baseline's lru without admission,
# quality's lfu with 0.5); the full grid crosses every eviction with every beta
COMBOS = (("lru", None), ("lfu", 0.5))
COMBOS_FULL = tuple((e, b) for e in policy_lib.EVICTIONS
                    for b in (None, 0.25, 0.5, 1.0, 2.0))


class AutoTuneError(ValueError):
  """A budget no point meets, or a bad flag; one line naming the flag and the nearest
  feasible value."""


@dataclasses.dataclass(frozen=True)
class Budget:
  """ppl_pct: the largest perplexity increase allowed (%); tpot_ms: the longest projected
  time per token on `profile`.  At least one is set."""
  ppl_pct: float | None = None
  tpot_ms: float | None = None
  profile: str | None = None

  def __post_init__(self):
    if self.ppl_pct is None and self.tpot_ms is None:
      raise AutoTuneError("--policy=auto needs --ppl_budget (percent perplexity increase) or "
                          "--tpot_budget_ms with --profile")
    if self.ppl_pct is not None and not self.ppl_pct > 0:
      raise AutoTuneError(f"--ppl_budget must be > 0 (percent), got {self.ppl_pct}; the "
                          "nearest feasible is --policy=fetch_all (0%)")
    if self.tpot_ms is not None:
      if self.profile is None:
        raise AutoTuneError(f"--tpot_budget_ms needs --profile (one of "
                            f"{', '.join(hardware.HARDWARE)})")
      if not self.tpot_ms > 0:
        raise AutoTuneError(f"--tpot_budget_ms must be > 0, got {self.tpot_ms}")

  def describe(self) -> str:
    parts = []
    if self.ppl_pct is not None:
      parts.append(f"perplexity +{self.ppl_pct:g}%")
    if self.tpot_ms is not None:
      parts.append(f"{self.tpot_ms:g} ms/token on {self.profile}")
    return " and ".join(parts)


# ------------------------------------------------------------------ the grid
def cost_available() -> bool:
  """Whether the policy module has the `cost` rule with a lambda knob (`lam`)."""
  return ("cost" in policy_lib.MISS_RULES
          and "lam" in inspect.signature(policy_lib.make_policy).parameters)


def grid(taus=TAUS, combos=COMBOS, lams=LAMS, extra=("quality", "speed"),
         low_bits=(8,)) -> list[PolicyParams]:
  """fetch_all, threshold(tau) and, when available, cost(lambda) with each of `low_bits`'
  low-precision copies under each (eviction, admission beta) of `combos`, and the `extra`
  presets / rules; duplicates removed."""
  out = [policy_lib.make_policy("fetch_all")]
  for ev, b in combos:
    out += [policy_lib.make_policy("threshold", tau=t, eviction=ev, admission_beta=b)
            for t in taus]
    if cost_available():
      out += [policy_lib.make_policy("cost", lam=l, eviction=ev, admission_beta=b,
                                     low_bits=bits) for bits in low_bits for l in lams]
  out += [policy_lib.make_policy(p) for p in extra]
  return unique(out)


def unique(policies) -> list[PolicyParams]:
  seen, out = set(), []
  for p in policies:
    k = key(p)
    if k not in seen:
      seen.add(k)
      out.append(p)
  return out


def key(p: PolicyParams) -> tuple:
  """Policies equal up to their display name (a preset and its spelled-out rule)."""
  return (p.decision, p.cache)


def label(p: PolicyParams) -> str:
  """A preset's name, else the rule (`PolicyParams.describe`)."""
  return p.name or p.describe()


# ------------------------------------------------------------------ the sweep
@dataclasses.dataclass
class Point:
  policy: PolicyParams
  mass: float                   # substituted + dropped mass per token and MoE layer
  fetches_per_token: float      # sync fetches per token, bf16-equivalent (low: low_ratio)
  waited_bytes: float           # waited bf16 bytes per token
  ms: dict                      # profile -> projected ms per token
  tokens: int


def tile_layers(steps_TxLxC: np.ndarray, layers: int) -> np.ndarray:
  """The trace's per-layer counts repeated over `layers` MoE layers (a target shape with
  more layers than the traced model)."""
  reps = -(-layers // steps_TxLxC.shape[1])
  return np.tile(steps_TxLxC, (1, reps, 1))[:, :layers]


def low_ratio(cfg, policy: PolicyParams) -> float:
  """A low-precision copy's bytes over the bf16 expert's, for `policy`'s precision (0 for
  rules that never fetch one)."""
  if not getattr(policy.decision, "low", False):
    return 0.0
  from moejax.io import quant      # only with the low-precision rules
  h, i = cfg.hidden_size, cfg.moe_intermediate_size
  shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
  return quant.low_nbytes(shapes, policy.decision.low_bits) / quant.bf16_nbytes(shapes)


def low_weight(policy: PolicyParams) -> float:
  """The quality proxy's weight of mass served by a low-precision copy, relative to
  substituted mass: the cost model's slopes (0 for rules without low copies)."""
  if not getattr(policy.decision, "low", False):
    return 0.0
  m = policy.decision.cost_model()
  return m.low_slope / max(m.sub_slope, 1e-12)


def _total(r, name: str) -> float:
  return r.total(name) if name in simulator.STAT_FIELDS else 0.0


def sweep(cfg, logits, policies, *, times: dict, shape_layers: int, expert_bytes: int,
          cache_fraction: float = 0.25, prefill_tokens: int = 1, progress=None) -> list[Point]:
  """Replays every trace of `logits` ([T, L, R] each: independent streams, each cache
  starting empty with a `prefill_tokens` prompt, as the emulator's streams) under every
  policy; totals summed over the streams.  times: profile name -> TimeParams.  The proxy
  is substituted + dropped mass, plus low-precision mass x `low_weight`; waited bytes
  count a low-precision fetch as `low_ratio` of a bf16 one."""
  policies = list(policies)
  n = len(policies)
  mass, fetches, tokens = np.zeros(n), np.zeros(n), 0
  steps = [[] for _ in range(n)]
  for lg in logits:
    res = simulator.simulate(cfg, lg, policies, cache_fraction=cache_fraction,
                             prefill_tokens=prefill_tokens)
    tokens += res[0].tokens
    for i, (p, r) in enumerate(zip(policies, res)):
      mass[i] += (r.total("substituted_mass") + r.total("dropped_mass")
                  + low_weight(p) * _total(r, "low_mass"))
      fetches[i] += r.total("fetches") + low_ratio(cfg, p) * _total(r, "fetches_low")
      steps[i].append(r.steps_TxLxC)
    if progress is not None:
      progress(1)
  nl = len(cfg.moe_layers)
  out = []
  for i, p in enumerate(policies):
    st = tile_layers(np.concatenate(steps[i]), shape_layers)
    ms = {}
    for name, tp in times.items():
      if hasattr(tp, "low_ratio") and low_ratio(cfg, p):
        tp = dataclasses.replace(tp, low_ratio=low_ratio(cfg, p))
      ms[name] = 1e3 * float(np.mean(timemodel.time_per_token(st, tp)))
    out.append(Point(p, mass[i] / max(tokens * nl, 1), fetches[i] / max(tokens, 1),
                     fetches[i] / max(tokens, 1) * expert_bytes, ms, tokens))
  return out


def time_params(profiles, shape: hardware.ModelShape) -> dict:
  """profile name -> the roofline TimeParams of `shape` on it."""
  return {p: timemodel.roofline(hardware.hardware(p), shape) for p in profiles}


# ------------------------------------------------------------------ refining a knob
def knob(p: PolicyParams) -> str | None:
  """The numeric knob the sweep tunes for `p`'s rule: tau (threshold), lam (cost)."""
  return {"threshold": "tau", "cost": "lam"}.get(p.miss)


def family(p: PolicyParams) -> tuple:
  """`key` with the knob blanked: policies that differ only in their knob."""
  k = knob(p)
  d = dataclasses.replace(p.decision, **{k: 1.0}) if k else p.decision
  return (d, p.cache)


def refine(policies, i: int, n: int = 4) -> list[PolicyParams]:
  """Policies of i's family with the knob between i's value and each adjacent value of the
  family in `policies` (n per side, geometric, 3 significant digits): a finer sweep around
  a choice, where the budget's boundary lies."""
  p = policies[i]
  k = knob(p)
  if k is None:
    return []
  vals = sorted({getattr(q.decision, k) for q in policies if family(q) == family(p)})
  at = vals.index(getattr(p.decision, k))
  out = []
  for j in (at - 1, at + 1):
    if 0 <= j < len(vals):
      lo, hi = sorted((vals[at], vals[j]))
      for v in np.geomspace(max(lo, 1e-6), hi, n + 2)[1:-1]:
        d = dataclasses.replace(p.decision, **{k: float(f"{v:.3g}")})
        out.append(PolicyParams(d, p.cache))
  return unique(out)


# ------------------------------------------------------------------ choice and frontier
def pareto(x, y) -> np.ndarray:
  """[N] bool: no other point is at least as good on both and better on one (lower x,
  lower y)."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  le = (x[None, :] <= x[:, None]) & (y[None, :] <= y[:, None])
  lt = (x[None, :] < x[:, None]) | (y[None, :] < y[:, None])
  return ~np.any(le & lt, axis=1)


def choose(dppl, ms, budget: Budget, candidates=None, labels=None) -> int:
  """The index of the fastest point within the perplexity budget (ties: the lower
  increase), or with no perplexity budget the least increase within the time budget.
  Raises AutoTuneError naming the flag and the nearest feasible value."""
  dppl, ms = np.asarray(dppl, float), np.asarray(ms, float)
  cand = np.ones(len(dppl), bool) if candidates is None else np.asarray(candidates, bool)
  ok = cand.copy()
  if budget.tpot_ms is not None:
    ok &= ms <= budget.tpot_ms
  if budget.ppl_pct is not None:
    ok &= dppl <= budget.ppl_pct
  if not ok.any():
    raise AutoTuneError(_infeasible(dppl, ms, budget, cand, labels))
  idx = np.flatnonzero(ok)
  first, second = (ms, dppl) if budget.ppl_pct is not None else (dppl, ms)
  return int(idx[np.lexsort((second[idx], first[idx]))[0]])


def _infeasible(dppl, ms, budget: Budget, cand, labels) -> str:
  name = lambda i: labels[i] if labels is not None else f"point {i}"
  if budget.tpot_ms is not None:
    fast = cand & (ms <= budget.tpot_ms)
    if not fast.any():
      i = int(np.flatnonzero(cand)[np.argmin(ms[cand])])
      return (f"--tpot_budget_ms={budget.tpot_ms:g}: no policy is projected that fast on "
              f"{budget.profile}; the fastest, {name(i)}, takes {ms[i]:.3g} ms "
              f"(nearest feasible: --tpot_budget_ms={_up(ms[i])})")
    cand = fast
  i = int(np.flatnonzero(cand)[np.argmin(dppl[cand])])
  return (f"--ppl_budget={budget.ppl_pct:g}: no substituting policy is predicted within "
          f"+{budget.ppl_pct:g}% perplexity; the closest, {name(i)}, is at +{dppl[i]:.3g}% "
          f"(nearest feasible: --ppl_budget={_up(dppl[i])}, or --policy=fetch_all)")


def _up(v: float) -> str:
  """v rounded up to 3 significant digits (a budget that admits it)."""
  if v <= 0:
    return "0"
  e = 10.0 ** (np.floor(np.log10(v)) - 2)
  return f"{np.ceil(v / e - 1e-9) * e:.3g}"


@dataclasses.dataclass
class Choice:
  index: int                 # into the sweep
  predicted_pct: float       # the fit's prediction for it (before its measurement)
  measured_pct: float        # the emulator's, on the calibration streams
  fit: QualityFit            # the final fit
  checks: list               # [(label, predicted, measured)] in the order measured
  reason: str


def tune(points: list[Point], measured: dict, measure, budget: Budget, *, max_checks: int = 3,
         profile: str | None = None) -> Choice:
  """Chooses a point of `points` for `budget`.

  measured: {sweep index: dPPL %} already emulated on the calibration streams (the
  fit's anchors; fetch_all's 0 among them or implied); measure(policy) -> dPPL % runs
  the emulator.  Each round fits the proxy on every measurement, takes `choose` on
  the predictions (measured values replace them), and measures that point if it is
  not measured yet; after `max_checks` measurements, or when the choice is already
  measured, the answer is `choose` over the measured points only.  `profile`: the
  time axis when the budget is a perplexity budget (default: the budget's, else the
  first profile of the sweep).
  """
  measured = dict(measured)
  prof = budget.profile or profile or next(iter(points[0].ms))
  mass = np.asarray([p.mass for p in points])
  ms = np.asarray([p.ms[prof] for p in points])
  labels = [label(p.policy) for p in points]
  cand = np.asarray([p.policy.miss != "fetch_all" for p in points])
  checks, predicted = [], {}
  for _ in range(max_checks + 1):
    fit = fit_quality([mass[i] for i in measured], list(measured.values()))
    pred = fit.predict(mass)
    for i, v in measured.items():
      pred[i] = v
    i = choose(pred, ms, budget, cand, labels)
    if i in measured or len(checks) >= max_checks:
      break
    predicted[i] = float(pred[i])
    measured[i] = float(measure(points[i].policy))
    checks.append((labels[i], predicted[i], measured[i]))
  known = np.zeros(len(points), bool)
  known[list(measured)] = True
  vals = np.full(len(points), np.inf)
  for j, v in measured.items():
    vals[j] = v
  i = choose(vals, ms, budget, cand & known, labels)
  fit = fit_quality([mass[j] for j in measured], list(measured.values()))
  why = (f"the fastest of {int(cand.sum())} swept policies whose measured perplexity "
         f"increase meets {budget.describe()}" if budget.ppl_pct is not None else
         f"the least measured perplexity increase among the swept policies within "
         f"{budget.describe()}")
  return Choice(i, predicted.get(i, float(fit.predict(mass[i]))), float(measured[i]), fit,
                checks, f"{why} ({prof}: {ms[i]:.3g} ms/token projected)")
