"""A miss policy's parameters: the miss rules, evictions and substitutions there are, the
two hashable parts `decide` and the cache read (`DecideParams`, `CacheParams`), the
presets, and `make_policy`, which builds one from a name and flags with errors that name
the flag.  The decision itself is `moejax.cache.policy.decide` (which re-exports these)."""

from __future__ import annotations

import dataclasses

from moejax.cache import cost as cost_lib

MISS_RULES = ("fetch_all", "threshold", "first_choice", "substitute_all", "host",
              "fetch_low", "threshold_low", "cost")
EVICTIONS = ("lru", "lfu", "least_stale")
SUBSTITUTIONS = ("next_best", "drop")


class PolicyError(ValueError):
  """A policy the user asked for that does not exist or has an invalid parameter."""


@dataclasses.dataclass(frozen=True)
class DecideParams:
  """What `decide` reads: the miss rule, substitution variant and admission threshold.

  Hashable: the static argument (compile-cache key) of jitted decision steps.
  """
  miss: str = "fetch_all"
  tau: float = 0.15
  substitution: str = "next_best"
  admission_beta: float | None = None    # None: no background admission
  tau_low: float = 0.02                  # threshold_low: low-precision fetch at share >= it
  low_bits: int = 8                      # the low-precision copy: int8 or int4
  lam: float = 1.0                       # cost: ms per % PPL
  cost: cost_lib.CostModel | None = None  # cost: None = cost.default_model(low_bits)

  def __post_init__(self):
    if self.miss not in MISS_RULES:     # (PRESETS: defined below, read only on an error)
      raise PolicyError(f"miss: unknown miss rule {self.miss!r}; choose one of "
                        f"{', '.join(MISS_RULES + tuple(PRESETS))}")
    _check_share("tau", self.tau)
    _check_choice("substitution", "variant", self.substitution, SUBSTITUTIONS)
    if self.admission_beta is not None and not self.admission_beta > 0:
      raise PolicyError(f"admission_beta must be > 0, got {self.admission_beta}")
    _check_share("tau_low", self.tau_low)
    if self.low_bits not in (8, 4):
      raise PolicyError(f"low_bits must be 8 or 4, got {self.low_bits}")
    if not self.lam >= 0:
      raise PolicyError(f"lam must be >= 0 (0: never wait), got {self.lam}")

  @property
  def low(self) -> bool:
    """Whether the rule can fetch low-precision copies (the store needs them)."""
    return self.miss in ("fetch_low", "threshold_low", "cost")

  @property
  def host(self) -> bool:
    """Whether the rule can compute a miss on the host."""
    return self.miss == "host" or (self.miss == "cost" and self.cost_model().host_ms is not None)

  def cost_model(self) -> cost_lib.CostModel:
    return self.cost or cost_lib.default_model(self.low_bits)


@dataclasses.dataclass(frozen=True)
class CacheParams:
  """What eviction (`eviction.eviction_order`, `resident.insert`) and `update_usage` read.

  Hashable: the static argument (compile-cache key) of jitted insert/usage steps.
  """
  eviction: str = "lru"
  lfu_decay: float = 0.98

  def __post_init__(self):
    _check_choice("eviction", "policy", self.eviction, EVICTIONS)
    _check_share("lfu_decay", self.lfu_decay)


def _check_choice(field: str, what: str, value, choices):
  """PolicyError (naming `field` first: `make_policy` maps it to its flag) unless `value`
  is one of `choices`."""
  if value not in choices:
    raise PolicyError(f"{field}: unknown {what} {value!r}; choose one of {', '.join(choices)}")


def _check_share(field: str, value: float):
  if not 0.0 < value <= 1.0:
    raise PolicyError(f"{field} must be in (0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class PolicyParams:
  """A complete policy: the decision rule, the cache rule and a display name.

  Every function here takes the part it reads (`DecideParams` or `CacheParams`)
  or a whole PolicyParams, so a jitted step keyed on a part compiles once for
  all policies that share it.
  """
  decision: DecideParams = DecideParams()
  cache: CacheParams = CacheParams()
  name: str = ""

  # read-only views of the parts' fields
  miss = property(lambda self: self.decision.miss)
  tau = property(lambda self: self.decision.tau)
  substitution = property(lambda self: self.decision.substitution)
  admission_beta = property(lambda self: self.decision.admission_beta)
  eviction = property(lambda self: self.cache.eviction)
  lfu_decay = property(lambda self: self.cache.lfu_decay)

  def describe(self) -> str:
    rule = {"threshold": f"threshold({self.tau:g})", "cost": f"cost(lam={self.decision.lam:g}, "
            f"int{self.decision.low_bits})", "threshold_low": f"threshold_low({self.tau:g}, "
            f"{self.decision.tau_low:g}, int{self.decision.low_bits})"}.get(self.miss, self.miss)
    parts = [rule, self.eviction]
    if self.substitution == "drop" and self.miss in ("threshold", "first_choice",
                                                     "substitute_all", "threshold_low", "cost"):
      parts.append("drop")
    if self.admission_beta is not None:
      parts.append(f"admission({self.admission_beta:g})")
    s = " + ".join(parts)
    return f"{self.name} = {s}" if self.name else s


def decide_params(params: DecideParams | PolicyParams) -> DecideParams:
  return params.decision if isinstance(params, PolicyParams) else params


def cache_params(params: CacheParams | PolicyParams) -> CacheParams:
  return params.cache if isinstance(params, PolicyParams) else params


PRESETS = {
    "quality": dict(miss="threshold", tau=0.15, eviction="lfu", admission_beta=0.5),
    "speed": dict(miss="first_choice", eviction="lfu", admission_beta=0.5),
    "baseline": dict(miss="fetch_all", eviction="lru"),
}


_FLAGS = dict(miss="--policy", tau="--tau", substitution="--substitution",
              admission_beta="--admission_beta", eviction="--eviction",
              lfu_decay="--lfu_decay", tau_low="--tau_low", low_bits="--low_bits", lam="--lam")


def make_policy(name: str, *, tau: float | None = None, eviction: str | None = None,
                admission_beta: float | None = None, substitution: str | None = None,
                lfu_decay: float | None = None, tau_low: float | None = None,
                low_bits: int | None = None, lam: float | None = None,
                cost: cost_lib.CostModel | None = None) -> PolicyParams:
  """A preset (quality/speed/baseline) or a miss rule, with optional overrides.

  Overrides given as None keep the preset's (or the default) value.  For a plain
  miss rule, admission is off unless `admission_beta` is given.  Errors name the
  command-line flag of the offending value.
  """
  if name in PRESETS:
    kw = dict(PRESETS[name])
  elif name in MISS_RULES:
    kw = dict(miss=name)
  else:
    raise PolicyError(f"--policy: unknown policy or preset {name!r}; choose one of "
                      f"{', '.join(tuple(PRESETS) + MISS_RULES)}")
  for k, v in (("tau", tau), ("eviction", eviction), ("admission_beta", admission_beta),
               ("substitution", substitution), ("lfu_decay", lfu_decay), ("tau_low", tau_low),
               ("low_bits", low_bits), ("lam", lam), ("cost", cost)):
    if v is not None:
      kw[k] = v
  cache_kw = {k: kw.pop(k) for k in ("eviction", "lfu_decay") if k in kw}
  try:
    return PolicyParams(DecideParams(**kw), CacheParams(**cache_kw),
                        name=name if name in PRESETS else "")
  except PolicyError as e:
    field = str(e).split(":")[0].split(" ")[0]
    raise PolicyError(f"{_FLAGS.get(field, field)}: {e}") from None
