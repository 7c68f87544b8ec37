"""The host->device link an expert crosses: native, emulated, or scaled to a GPU.

On a machine without an accelerator a `jax.device_put` is a memcpy and costs
almost nothing, so offloading would look free.  An *emulated* link makes a
transfer of n bytes complete no earlier than ``n / bandwidth + latency`` after
it starts (`sleep_until`), while compute runs for real.

The bandwidth can be given in absolute terms (``--link=16GB/s,10us``) or
*scaled* to a hardware profile (``--link=scaled:qwen3-30b-a3b@rtx3090``): what
decides whether offloading pays is the ratio

    rho = (one expert's transfer time) / (one layer's decode compute time)

so the emulated bandwidth is chosen to give the same rho on this machine:

    bandwidth = expert_bytes_here / (rho_profile * layer_compute_s_here)

Every reported time names its link (`Link.describe`).

The profiles' rho (moejax.offload.hardware holds the numbers) is derived in
docs/design.md, "Links".
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import numpy as np

from moejax.io.placement import TransferTimeout
from moejax.offload import hardware


class LinkSpecError(ValueError):
  """A --link value that does not parse; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class Link:
  """A host->device link: native (bandwidth None) or emulated (bytes/s + latency)."""
  name: str
  bandwidth_Bps: float | None  # None = native: only the real device_put cost
  latency_s: float = 0.0
  profile: str | None = None   # MODEL@GPU of a scaled link (moejax.offload.hardware)

  @property
  def emulated(self) -> bool:
    return self.bandwidth_Bps is not None

  def transfer_time(self, nbytes: int) -> float:
    """Seconds the emulated link needs for `nbytes` (0 for a native link)."""
    if self.bandwidth_Bps is None:
      return 0.0
    return nbytes / self.bandwidth_Bps + self.latency_s

  def describe(self) -> str:
    """Human text naming the link; every printed time should carry it."""
    if self.bandwidth_Bps is None:
      return f"{self.name} link (the real copy's cost, no emulation)"
    emu = f"emulated {format_bandwidth(self.bandwidth_Bps)} + {format_latency(self.latency_s)}"
    return emu if self.name == emu else f"{self.name} -> {emu}"


  def as_dict(self) -> dict:
    """JSON-ready description (bench outputs record the link they used)."""
    d = {"name": self.name, "describe": self.describe(), "bandwidth_Bps": self.bandwidth_Bps,
         "latency_s": self.latency_s, "profile": self.profile}
    if self.profile is not None:
      _, shape, hw = hardware.scaled_profile(self.profile)
      d["profile_ratio"] = hw.ratio(shape)
      d["profile_expert_transfer_s"] = hw.expert_transfer_s(shape)
      d["profile_layer_compute_s"] = hw.layer_compute_s(shape)
    return d


NATIVE = Link("native", None)


DEFAULT_PROFILE = hardware.DEFAULT_SCALED


def scaled_link(profile: str, expert_bytes: int, layer_compute_s: float,
                flag: str = "--link") -> Link:
  """The emulated link that gives this machine the profile's ratio rho.

  `expert_bytes` and `layer_compute_s` are measured on THIS machine for the
  model being run (one expert's bytes as stored, one MoE layer's decode time).
  """
  try:
    key, shape, hw = hardware.scaled_profile(profile)
  except hardware.ProfileError as e:
    raise LinkSpecError(f"{flag}=scaled:{profile}: {e}") from None
  if not expert_bytes or expert_bytes <= 0 or not layer_compute_s or layer_compute_s <= 0 \
      or not math.isfinite(layer_compute_s):
    raise LinkSpecError(
        f"{flag}=scaled:{key} needs expert_bytes and layer_compute_s measured on this machine "
        f"(got expert_bytes={expert_bytes}, layer_compute_s={layer_compute_s})")
  rho = hw.ratio(shape)
  bw = expert_bytes / (rho * layer_compute_s)
  return Link(f"scaled: {hw.title(shape)}, rho {rho:.3g}", bw, 0.0, profile=key)


_NUM = r"(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
_BW_UNITS = {"B/s": 1.0, "KB/s": 1e3, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
             "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30}
_LAT_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0}
_TERM = re.compile(_NUM + r"\s*(" + "|".join(re.escape(u) for u in
                                            sorted({**_BW_UNITS, **_LAT_UNITS}, key=len,
                                                   reverse=True)) + r")")


def _usage(flag: str) -> str:
  return (f"expected '{flag}=native', '{flag}=scaled' or '{flag}=scaled:MODEL@GPU' (models: "
          f"{', '.join(hardware.MODELS)}; GPUs: {', '.join(hardware.HARDWARE)}), "
          f"or a bandwidth with optional latency "
          f"such as '{flag}=16GB/s,10us' or '{flag}=\"16 GB/s + 10 us\"' "
          f"(units: GB/s, MB/s, GiB/s, ...; us, ms, ns, s)")


def default_spec(platform: str) -> str:
  """--link's default: the real copy on an accelerator; on a CPU-only machine, where a
  native copy costs almost nothing, the scaled emulated link."""
  return "scaled" if platform == "cpu" else "native"


def parse_link(spec: str, *, expert_bytes: int | None = None,
               layer_compute_s: float | None = None, flag: str = "--link") -> Link:
  """Parses a --link value into a Link (see the module docstring)."""
  if not isinstance(spec, str) or not spec.strip():
    raise LinkSpecError(f"{flag}={spec!r}: empty link spec; {_usage(flag)}")
  s = spec.strip()
  low = s.lower()
  if low == "native":
    return NATIVE
  if low == "scaled" or low.startswith("scaled:"):
    prof = s.split(":", 1)[1] if ":" in s else DEFAULT_PROFILE
    return scaled_link(prof, expert_bytes, layer_compute_s, flag)
  parts = [p.strip() for p in re.split(r",|(?<=[sS])\s*\+", s)]
  bw = lat = None
  for part in parts:
    m = _TERM.fullmatch(part)
    if m is None:
      raise LinkSpecError(f"{flag}={spec!r}: cannot parse {part!r}; {_usage(flag)}")
    value, unit = float(m.group(1)), m.group(2)
    if unit in _BW_UNITS:
      if bw is not None:
        raise LinkSpecError(f"{flag}={spec!r}: two bandwidths given; {_usage(flag)}")
      bw = value * _BW_UNITS[unit]
    else:
      if lat is not None:
        raise LinkSpecError(f"{flag}={spec!r}: two latencies given; {_usage(flag)}")
      lat = value * _LAT_UNITS[unit]
  if bw is None:
    raise LinkSpecError(f"{flag}={spec!r}: no bandwidth given; {_usage(flag)}")
  if not (math.isfinite(bw) and bw > 0):
    raise LinkSpecError(f"{flag}={spec!r}: bandwidth must be positive and finite")
  lat = lat or 0.0
  if not math.isfinite(lat):
    raise LinkSpecError(f"{flag}={spec!r}: latency must be finite")
  return Link(f"emulated {format_bandwidth(bw)} + {format_latency(lat)}", bw, lat)


def format_bandwidth(bps: float) -> str:
  if bps >= 1e9:
    return f"{bps / 1e9:.1f} GB/s"
  if bps >= 1e6:
    return f"{bps / 1e6:.1f} MB/s"
  return f"{bps / 1e3:.1f} KB/s"


def format_latency(s: float) -> str:
  if s >= 1e-3:
    return f"{s * 1e3:.3g} ms"
  return f"{s * 1e6:.3g} us"


# ------------------------------------------------------------------ emulated clock
class LinkClock:
  """The emulated link's time for decoded tokens, from what each MoE layer copied.

  The engine's program makes every copy itself, at memcpy speed on a CPU; with an
  emulated link the host then waits out the time the copies would have taken, per
  token, from the token's measured compute time c (spread evenly over its n MoE
  layers, half before the layer's decision: attention and router, half after: its
  experts) and, per layer in order, its counts of waited fetches, admissions requested
  and experts prefetched for it:

    before the decision: wait for the layer's admissions (requested at the previous
                    token); after it, request the next layer's predicted experts
                    (they overlap this layer's experts and the next one's attention);
    before the experts: wait for the layer's own prefetched experts; its f waited
                    fetches take the link at once (f x one expert's transfer time +
                    latency; background transfers on the link are pushed back);
    after them:     its admissions queue behind whatever the link still carries.

  Transfers queued at the end of a token carry over to the next.  `token` returns the
  token's emulated seconds and its waits; the caller sleeps the difference to its
  compute time.  Pure host arithmetic: no thread, no device call.

  links > 1 (expert-parallel: every device has its own link to the host): the counts are
  per layer arrays [links], each link carries its own device's copies, and a wait lasts
  until the last of the links it waits on is done.
  """

  def __init__(self, link: Link, expert_bytes: int, moe_layers: tuple[int, ...],
               links: int = 1):
    self.link = link
    self.links = int(links)
    self.expert_s = link.transfer_time(expert_bytes) - link.latency_s if link.emulated else 0.0
    self.moe_layers = tuple(moe_layers)
    self.reset()

  def reset(self):
    """A new sequence: nothing on the links."""
    self._free = np.zeros(self.links)                 # each link busy until (token-relative)
    self._admit = {l: np.zeros(self.links) for l in self.moe_layers}   # admissions arrive

  def _counts(self, n) -> np.ndarray:
    return np.broadcast_to(np.asarray(n, np.float64), (self.links,))

  def _burst(self, n: np.ndarray) -> np.ndarray:
    return n * self.expert_s + np.where(n > 0, self.link.latency_s, 0.0)

  def _wait(self, t: float, until: float, waits: dict, key: str) -> float:
    if until > t:
      waits[key] += until - t
      return until
    return t

  def charge(self, t0: float, what: str, timeout_s: float, fetches, admissions,
             prefetches) -> dict:
    """Sleeps out the emulated time of `what` (copies counted per MoE layer, as `token`)
    whose compute started at t0 (`time.perf_counter`) -> its waits.  Raises
    TransferTimeout, after sleeping `timeout_s` past the compute, where the copies would
    take longer than that."""
    compute = time.perf_counter() - t0
    emulated, waits = self.token(compute, fetches, admissions, prefetches)
    if emulated - compute > timeout_s:
      sleep_until(t0 + compute + timeout_s)
      raise TransferTimeout(f"the emulated link needs {emulated - compute:.3g} s for the "
                            f"copies of {what}, beyond transfer_timeout_s={timeout_s:g}")
    sleep_until(t0 + emulated)
    return waits

  def token(self, compute_s: float, fetches, admissions, prefetches) -> tuple[float, dict]:
    """-> (emulated seconds of the token, {"wait_s", "admission_wait_s",
    "prefetch_wait_s"}); counts are per MoE layer (numbers, or arrays [links]),
    prefetches[j] those for layer j."""
    waits = dict(wait_s=0.0, admission_wait_s=0.0, prefetch_wait_s=0.0)
    if not self.link.emulated:
      return compute_s, waits
    half = compute_s / max(1, len(self.moe_layers)) / 2
    n = len(self.moe_layers)
    none = np.zeros(self.links)
    t, pf_at, admit, free = 0.0, none, {}, self._free.copy()
    for j, l in enumerate(self.moe_layers):
      t = self._wait(t, float(np.max(self._admit[l])), waits, "admission_wait_s") + half
      nxt_pf_at = none
      pf = self._counts(prefetches[j + 1]) if j + 1 < n else none
      if np.any(pf > 0):
        free = np.where(pf > 0, np.maximum(free, t) + self._burst(pf), free)
        nxt_pf_at = np.where(pf > 0, free, 0.0)
      t = self._wait(t, float(np.max(pf_at)), waits, "prefetch_wait_s")
      f = self._counts(fetches[j])
      if np.any(f > 0):
        d = self._burst(f)
        waits["wait_s"] += float(np.max(d))
        pushed = free > t        # each link's background transfers are pushed back
        free = np.where(pushed, free + d, free)
        nxt_pf_at = np.where(pushed & (nxt_pf_at > 0), nxt_pf_at + d, nxt_pf_at)
        admit = {a: np.where(pushed & (at > t), at + d, at) for a, at in admit.items()}
        self._admit = {a: np.where(pushed & (at > t), at + d, at)
                       for a, at in self._admit.items()}
        t += float(np.max(d))
      t += half
      a = self._counts(admissions[j])
      if np.any(a > 0):
        free = np.where(a > 0, np.maximum(free, t) + self._burst(a), free)
        admit[l] = np.where(a > 0, free, 0.0)
      pf_at = nxt_pf_at
    self._admit = {l: np.maximum(0.0, admit.get(l, none) - t) for l in self.moe_layers}
    self._free = np.maximum(0.0, free - t)
    return t, waits


def sleep_until(deadline: float, spin_s: float = 2e-4):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop
  (a plain sleep on a loaded machine overshoots by milliseconds)."""
  while (left := deadline - time.perf_counter()) > 0:
    time.sleep(left - spin_s if left > 2 * spin_s else 0)
