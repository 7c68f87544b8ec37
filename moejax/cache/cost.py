"""Which misses wait, and in which precision; the cost model of a miss.

`miss_masks` is the miss rule of `policy.decide`.  Besides the seed's rules (fetch_all,
threshold(tau), first_choice, substitute_all, host):

  fetch_low    every miss waits for its low-precision copy (FETCH_LOW);
  threshold_low(tau, tau_low)  as threshold (the first choice and share >= tau wait in
               full precision); the other misses with share >= tau_low wait for their
               low-precision copy (FETCH_LOW); the rest are substituted (or dropped);
  cost(lam)    per miss the option of least expected time + lam x quality cost
               (`--policy=cost --lam=L`), below.

Per miss of normalised share s (g / sum of the token's selected g) the options are

  option   expected time (ms)                        expected quality cost (% PPL)
  full     latency + bf16 bytes / link bandwidth     0
  low      latency + low bytes / link bandwidth      low_slope x s
  sub      0                                         sub_slope x s
  host     one expert on the host (if measured)      0
  drop     0                                         drop_slope x s

The host time is a measurement, never a guess: `measured_host_ms` reads it from a
number or from `moejax-host-ms`'s JSON (generate --policy=cost --host_ms=...);
without one the host option is not offered.  The policy takes the option with the
least time + lam x quality (ties: the order above, so the better-quality option).  A 'sub' for which no unused resident
expert is left becomes a DROP, as in every substituting rule.  lam is in ms per
percentage point of perplexity: 0 never waits (substitution is free); a huge lam
waits for every miss in full precision (`fetch_all`'s decisions) unless host compute
is measured and cheaper.  Times are per miss and independent (a token's waited
fetches share no latency): the model is a ranking, not a clock.

The slopes are the study's linear fit of the perplexity increase (%) against the
mass per token served otherwise than at full precision (substituted, dropped, or
dequantised: summed over MoE layers, `research.calibration.fit_slopes`), so one miss
of share s costs slope x s points of PPL.  `DEMO_SLOPES` are the demo model's,
measured with the emulator (docs/emulator.md, 'Low precision and the cost model').

Everything here is pure (floats and jnp on arrays), so `policy.decide` stays jittable;
`CostModel` is hashable (a static argument), `lam` may be traced (simulator sweeps).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

OPTIONS = ("full", "low", "sub", "host", "drop")
FULL, LOW, SUB, HOST, DROP = range(5)


@dataclasses.dataclass(frozen=True)
class Slopes:
  """% PPL per unit of mass per token served by each means (per model, per precision)."""
  sub: float
  drop: float
  low8: float
  low4: float

  def low(self, bits: int) -> float:
    return self.low8 if bits == 8 else self.low4


# the demo model (ckpts/demo), 25% resident, the study's streams (4096 tokens): `fit_slopes`
# of the emulator runs in docs/emulator.md ('Low precision and the cost model')
DEMO_SLOPES = Slopes(sub=7.5, drop=9.7, low8=0.001, low4=0.25)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Static per-miss times (ms) and quality slopes (% PPL per unit share)."""
  full_ms: float
  low_ms: float
  sub_slope: float
  low_slope: float
  drop_slope: float
  host_ms: float | None = None        # None: no host compute

  def __post_init__(self):
    for f in ("full_ms", "low_ms", "sub_slope", "low_slope", "drop_slope"):
      if not getattr(self, f) >= 0:
        raise ValueError(f"cost model: {f} must be >= 0, got {getattr(self, f)}")


def from_profile(expert_bf16_bytes: int, expert_low_bytes: int, link_Bps: float,
                 latency_s: float, slopes: Slopes = DEMO_SLOPES, bits: int = 8,
                 host_s: float | None = None) -> CostModel:
  """A CostModel from a hardware profile's link (and host expert time, when given)."""
  ms = lambda nbytes: 1e3 * (latency_s + nbytes / link_Bps)
  return CostModel(full_ms=ms(expert_bf16_bytes), low_ms=ms(expert_low_bytes),
                   sub_slope=slopes.sub, low_slope=slopes.low(bits), drop_slope=slopes.drop,
                   host_ms=None if host_s is None else 1e3 * host_s)


def measured_host_ms(spec) -> float:
  """One expert's time on the host in ms, as measured: a number, or the path of
  `moejax-host-ms`'s JSON (its "host_ms": the engine's HOST call for one expert at
  that run's shape, on that machine). ValueError for anything else, or a time <= 0."""
  try:
    ms = float(spec)
  except (TypeError, ValueError):
    import json   # pylint: disable=import-outside-toplevel
    try:
      with open(spec) as f:
        ms = json.load(f)["host_ms"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"host_ms: {spec!r} is neither a number of ms nor a bench_host JSON "
                       f"with 'host_ms' ({type(e).__name__}: {e})") from None
  if ms is None or not float(ms) > 0:
    raise ValueError(f"host_ms must be > 0 (ms per host expert), got {ms}")
  return float(ms)


def with_host(model: CostModel, host_ms: float | None) -> CostModel:
  """`model` with the host option's time (None: no host option)."""
  return dataclasses.replace(model, host_ms=host_ms)


def miss_masks(params, miss, first, share):
  """(wait full, wait low, host, drop) masks [N, K] of the misses under `params`' rule
  (a `policy.DecideParams`); the misses in none of them are substituted."""
  none = jnp.zeros_like(miss)
  low = host = drop = none
  if params.miss == "fetch_all":
    wait = miss
  elif params.miss in ("threshold", "threshold_low"):
    wait = miss & (first | (share >= params.tau))
    if params.miss == "threshold_low":
      low = miss & ~wait & (share >= params.tau_low)
  elif params.miss == "first_choice":
    wait = miss & first
  elif params.miss == "fetch_low":
    wait, low = none, miss
  elif params.miss == "cost":
    opt = choose(params.cost_model(), params.lam, share)
    wait, low = miss & (opt == FULL), miss & (opt == LOW)
    host, drop = miss & (opt == HOST), miss & (opt == DROP)
  else:  # substitute_all, host
    wait = none
  return wait, low, host, drop


def choose(model: CostModel, lam, share):
  """The option (FULL..DROP) of least time + lam x quality for each share [...]."""
  t = [model.full_ms, model.low_ms, 0.0, model.host_ms, 0.0]
  q = [0.0, model.low_slope, model.sub_slope, 0.0, model.drop_slope]
  best, best_cost = jnp.zeros(share.shape, jnp.int32), jnp.full(share.shape, jnp.inf)
  for i in range(len(OPTIONS)):
    if t[i] is None:
      continue
    c = t[i] + lam * q[i] * share
    take = c < best_cost
    best = jnp.where(take, i, best)
    best_cost = jnp.where(take, c, best_cost)
  return best


# the default times: one Qwen3-30B-A3B expert (3 x 2048 x 768) over the RTX 3090 profile's
# link (PCIe 4.0 x16, 25 GB/s, 10 us; moejax.offload.hardware), in bf16 and its int8 and
# int4 (group 32) copies (`io.quant.low_nbytes`); `generate --profile` gives others
QWEN3_30B_EXPERT_BYTES = {16: 9437184, 8: 4725760, 4: 2654208}


def default_model(bits: int = 8, slopes: Slopes = DEMO_SLOPES) -> CostModel:
  b = QWEN3_30B_EXPERT_BYTES
  return from_profile(b[16], b[bits], 25e9, 10e-6, slopes, bits)


def fit_slope(mass, dppl) -> float:
  """The least-squares slope through the origin of ΔPPL (%) against mass per token."""
  m, d = [float(x) for x in mass], [float(x) for x in dppl]
  den = sum(x * x for x in m)
  return sum(x * y for x, y in zip(m, d)) / den if den > 0 else 0.0


def fit_slopes(policies: dict, max_dppl: float = 10.0) -> Slopes:
  """Slopes from an emulation's per-policy metrics (`moejax-emulate`'s results.json
  "policies": spec -> {ppl_increase_pct, substituted_mass_per_token,
  dropped_mass_per_token, low_mass_per_token}): sub from the substituting specs
  (threshold:TAU, first_choice; not @drop), drop from the @drop ones, low8 / low4 from
  fetch_low / fetch_low@int4.  Points above `max_dppl` are left out: the cost model is
  linear in the share, and the increase grows faster than the mass beyond a few
  percent (substitute_all: +5000%), where no sensible operating point lies (a means
  with no point within it takes its mildest point's ratio)."""
  pts = {"sub": [], "drop": [], "low8": [], "low4": []}
  above = {k: [] for k in pts}
  for spec, m in policies.items():
    d = m.get("ppl_increase_pct")
    if d is None:
      continue
    name = spec.split(":")[0].split("@")[0]
    if name in ("threshold", "first_choice"):
      key, mass = (("drop", m["dropped_mass_per_token"]) if "@drop" in spec else
                   ("sub", m["substituted_mass_per_token"]))
    elif name == "fetch_low":
      key, mass = ("low4" if spec.endswith("@int4") else "low8"), m["low_mass_per_token"]
    else:
      continue
    (pts if d <= max_dppl else above)[key].append((mass, d))
  fit = {k: max(0.0, fit_slope([p[0] for p in v], [p[1] for p in v])) for k, v in pts.items()}
  for k, v in above.items():      # no point within max_dppl: the mildest one
    if not pts[k] and v:
      mass, d = min(v, key=lambda p: p[1])
      fit[k] = d / mass if mass > 0 else 0.0
  return Slopes(**fit)
