"""Runs policies through the emulator on one set of streams, caching each run on disk.

A run is saved as DIR/runs/KEY.npz once finished, so an interrupted study
resumes with the runs it has not done yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from moejax.research import emulator as E
from moejax.cache import policy as policy_lib
from moejax.offload.config import EngineConfig
from moejax.prefetch.steps import Prefetch
from moejax.research.study import metrics as metrics_lib


class SpecError(ValueError):
  """A policy spec on the command line that does not parse; names the flag."""


def parse_spec(spec: str, flag: str = "--policies"):
  """NAME[:TAU][@drop][@int4] -> (PolicyParams, None), or random:P -> (substitute_all,
  Control).

  NAME: a preset (quality, speed, baseline) or a miss rule (fetch_all, threshold,
  first_choice, substitute_all, host, fetch_low, threshold_low, cost); TAU: the
  threshold rule's tau (threshold_low:TAU:TAU_LOW; cost:LAMBDA, its lam); @drop: the
  drop substitution variant; @int4: int4 low-precision copies (default int8);
  random:P: the control substituting each miss with probability P, protecting nothing.
  """
  s = spec.strip()
  if not s:
    raise SpecError(f"{flag}: empty policy name")
  if s.startswith("random:"):
    try:
      p = float(s.split(":", 1)[1])
      return policy_lib.make_policy("substitute_all"), E.Control("random", prob=p)
    except (ValueError, E.EmulatorError) as e:
      raise SpecError(f"{flag}: {s!r}: {e}") from None
  int4 = s.endswith("@int4")
  s = s[:-5] if int4 else s
  drop = s.endswith("@drop")
  s = s[:-5] if drop else s
  name, _, tau = s.partition(":")
  tau, _, tau_low = tau.partition(":")
  try:
    num = dict(lam=float(tau)) if name == "cost" and tau else dict(
        tau=float(tau) if tau else None, tau_low=float(tau_low) if tau_low else None)
    pol = policy_lib.make_policy(name, substitution="drop" if drop else None,
                                 low_bits=4 if int4 else None, **num)
  except policy_lib.PolicyError as e:
    raise SpecError(f"{flag}: {spec!r}: {e}") from None
  except ValueError:
    raise SpecError(f"{flag}: {spec!r}: tau {tau!r} is not a number") from None
  return pol, None


@dataclasses.dataclass
class Runner:
  cfg: object
  params: object
  store: object
  streams: object
  out_dir: str
  max_len: int
  chunk: int = 256
  dtype: object = jnp.float32
  log: list = dataclasses.field(default_factory=list)     # per run: tokens, compile_s, run_s
  missing: list = dataclasses.field(default_factory=list)  # runs skipped (cached_only)

  def __post_init__(self):
    os.makedirs(os.path.join(self.out_dir, "runs"), exist_ok=True)
    self._stacked = None

  @property
  def stacked(self):
    if self._stacked is None:
      self._stacked = E.stack_layers(self.cfg, self.params, self.store.to_device(self.dtype))
    return self._stacked

  def run(self, key: str, policy, control=None, cache_fraction: float = 0.25,
          cached_only: bool = False, prefetch: Prefetch = Prefetch(),
          **make_kw) -> dict | None:
    """The summary of one emulation (from DIR/runs/KEY.npz when already done; None
    when it is not and cached_only).  prefetch: the engine's `Prefetch`; make_kw: the
    emulator's own `emulator.make` arguments (low_store, batch)."""
    path = os.path.join(self.out_dir, "runs", f"{key}.npz")
    if os.path.exists(path):
      with np.load(path) as z:
        run = {k: (z[k] if z[k].ndim else float(z[k])) for k in z.files}
      if len(run["totals"]) == len(E.STATS):   # else recorded before STATS grew: rerun
        return run
    if cached_only:
      self.missing.append(key)
      return None
    config = EngineConfig.make(policy, cache_fraction=cache_fraction, max_len=self.max_len,
                               dtype=self.dtype, prefetch=prefetch)
    em = E.make(self.cfg, self.params, self.store, config, control=control,
                stacked=self.stacked, **make_kw)
    s = self.streams
    t = s.tokens.shape[1]
    # disable=None: no bar where stderr is not a terminal (a log gets no bar text)
    with tqdm(total=s.tokens.shape[0] * (t - 1), desc=key, unit="tok", leave=False,
              disable=None) as bar:
      out = E.run_streams(em, s.tokens, s.pos, s.targets, chunk=min(self.chunk, t - 1),
                          on_chunk=bar.update)
    summ = metrics_lib.summarize_run(out, s, len(self.cfg.moe_layers))
    summ.update(compile_s=out["compile_s"], run_s=out["run_s"],
                decoded=float(s.tokens.shape[0] * (t - 1)))
    np.savez(path + ".tmp.npz", **summ)
    os.replace(path + ".tmp.npz", path)
    self.log.append(dict(key=key, compile_s=out["compile_s"], run_s=out["run_s"]))
    return summ


def _plain(o):
  if isinstance(o, np.ndarray):
    return o.tolist()
  if isinstance(o, np.generic):
    return o.item()
  raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def save_json(path: str, obj):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, default=_plain)
  os.replace(tmp, path)
