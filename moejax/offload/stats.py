"""Per-token records of the offload engine, their summary and its table.

A `TokenRecord` holds one decoded token's counts (summed over MoE layers) and
times, and per MoE layer a `LayerRecord` of what was decided and done there.
Inserts are attributed to the token and layer where they logically take effect
(an admission requested at token t for layer l: before layer l at token t+1),
however early the engine really made them, so records do not depend on thread
timing.  Masses are normalised shares g / sum(selected g).
"""

from __future__ import annotations

import array
import collections
import dataclasses

import numpy as np

from moejax.cache import step as step_lib
from moejax.cache.policy import FETCH, FETCH_LOW, HIT
from moejax.io import staging
from moejax.model.config import ModelConfig

COUNT_KEYS = ("expert_calls", "hits", "misses", "fetches", "fetch_bytes", "fetches_low",
              "fetch_low_bytes", "low_mass", "substituted",
              "substituted_mass", "dropped", "dropped_mass", "host_calls", "admissions",
              "admitted", "evictions", "prefetches", "useful_prefetches", "prefetch_bytes",
              "wasted_bytes", "recall_hits", "predicted_calls")
TIME_KEYS = ("wait_s", "admission_wait_s", "prefetch_wait_s", "host_s", "compute_s", "wall_s")
STAT_KEYS = COUNT_KEYS + TIME_KEYS


@dataclasses.dataclass(slots=True)
class LayerRecord:
  """One MoE layer of one token.  Expert ids, as tuples of ints (the garbage collector
  does not scan them: a long run's records do not slow its collections); actions are
  policy.HIT/FETCH/...

  ids          the K selected experts, by router score
  actions      their actions
  substitutes  the substitute of each (-1 unless SUBSTITUTE)
  fetched      experts fetched synchronously
  admissions   experts requested in the background (inserted at the next token)
  admitted     background admissions inserted before this layer's decision
  evicted      experts evicted by this layer's inserts and by its end-of-token trim
  predicted    the experts predicted for this layer at the layer before (speculative
               prefetch; empty: no prediction)
  prefetched   the predicted experts that were not resident and were requested
  true_ids     the true router's top-k (with prefetch on; `ids` are the predicted ones
               under speculative execution)
  """
  ids: tuple[int, ...] = ()
  actions: tuple[int, ...] = ()
  substitutes: tuple[int, ...] = ()
  fetched: tuple[int, ...] = ()
  admissions: tuple[int, ...] = ()
  admitted: tuple[int, ...] = ()
  evicted: tuple[int, ...] = ()
  predicted: tuple[int, ...] = ()
  prefetched: tuple[int, ...] = ()
  true_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class TokenRecord:
  """One token's counts (over MoE layers) and seconds; `record["hits"]` reads a field."""
  expert_calls: float = 0.0
  hits: float = 0.0
  misses: float = 0.0
  fetches: float = 0.0
  fetch_bytes: float = 0.0        # waited bytes: full fetches' and low-precision ones'
  fetches_low: float = 0.0        # waited fetches of low-precision copies (FETCH_LOW)
  fetch_low_bytes: float = 0.0    # ... their bytes (part of fetch_bytes)
  low_mass: float = 0.0           # their normalised shares
  substituted: float = 0.0
  substituted_mass: float = 0.0
  dropped: float = 0.0
  dropped_mass: float = 0.0
  host_calls: float = 0.0
  admissions: float = 0.0
  admitted: float = 0.0
  evictions: float = 0.0
  prefetches: float = 0.0         # speculative prefetches requested (experts)
  useful_prefetches: float = 0.0  # ... that the layer then executed
  prefetch_bytes: float = 0.0     # bytes of the prefetches requested
  wasted_bytes: float = 0.0       # bytes of prefetches not executed and not cancelled in time
  recall_hits: float = 0.0        # predicted experts in the true top-k (layers with a prediction)
  predicted_calls: float = 0.0    # K per layer with a prediction
  wait_s: float = 0.0             # blocked on synchronous fetches
  admission_wait_s: float = 0.0   # blocked on admissions not arrived by their insert
  prefetch_wait_s: float = 0.0    # blocked on prefetches not arrived by their layer
  host_s: float = 0.0             # host-computed experts
  compute_s: float = 0.0          # the rest of wall_s
  wall_s: float = 0.0
  tokens: int = 1                 # prompt length for the prefill record
  rows: int = 1                   # rows decoded in the token's step (a batch: they share its waits)
  device_hits: tuple = ()         # expert-parallel: hits served from each device's slots
  layers: dict[int, LayerRecord] = dataclasses.field(default_factory=dict)

  def __getitem__(self, key: str):
    return getattr(self, key)

  def finish(self, wall_s: float, wait_s: float = 0.0, admission_wait_s: float = 0.0,
             prefetch_wait_s: float = 0.0):
    """The token's wall time and its emulated-link waits; compute_s is the rest."""
    self.wall_s, self.wait_s = wall_s, wait_s
    self.admission_wait_s, self.prefetch_wait_s = admission_wait_s, prefetch_wait_s
    self.compute_s = wall_s - wait_s - admission_wait_s - prefetch_wait_s - self.host_s


_LAYER_IDS = ("ids", "actions", "substitutes", "fetched", "admissions", "admitted", "evicted",
              "predicted", "prefetched", "true_ids")
_DENSE = ("ids", "actions", "substitutes", "true_ids")     # K entries each, -1 kept


def build_record(rec, moe_layers, expert_bytes: int, low_bytes: int = 0,
                 plan=None, layers: bool = True) -> TokenRecord:
  """A decoded token's record from its decisions, a `cache.step.Record` of numpy arrays
  [L, ...] (rows in `moe_layers` order): the counts by `cache.step.counts`, the same
  function the emulator's statistics use.  Per layer, id lists drop the -1 padding (ids,
  actions, substitutes and true_ids keep their K entries).  `fetches` counts
  full-precision fetches, `fetches_low` low-precision ones (`low_bytes` each); `fetched`
  lists both.  plan: an `expert_parallel.Plan`, whose devices' hits are counted
  (`device_hits`).  layers=False: the counts alone (`layers` left empty)."""
  out = from_counts(np.sum(step_lib.record_counts(np, rec), axis=0, dtype=np.float64),
                    expert_bytes, low_bytes)
  if plan is not None:     # a hit's row is its global slot
    hits = per_device(rec.actions == HIT, rec.rows, plan.devices)
    out.device_hits = tuple(np.sum(hits, axis=0, dtype=np.float64).tolist())
  if layers:
    out.layers = layer_records(rec, moe_layers)
  return out


def from_counts(c_S, expert_bytes: int, low_bytes: int = 0) -> TokenRecord:
  """A TokenRecord of a token's `cache.step.STATS` counts (summed over MoE layers)."""
  tot = dict(zip(step_lib.STATS, np.asarray(c_S, np.float64).tolist()))
  out = TokenRecord(**{k: tot[k] for k in step_lib.STATS if k != "first_substituted"})
  out.misses = out.expert_calls - out.hits
  out.fetch_low_bytes = out.fetches_low * low_bytes
  out.fetch_bytes = out.fetches * expert_bytes + out.fetch_low_bytes
  out.prefetch_bytes = out.prefetches * expert_bytes
  out.wasted_bytes = (out.prefetches - out.useful_prefetches) * expert_bytes
  return out


def layer_records(rec, moe_layers) -> dict[int, LayerRecord]:
  """{MoE layer: LayerRecord} of a numpy `cache.step.Record` [L, ...]."""
  ints = {name: np.asarray(getattr(rec, name)).astype(np.int64).tolist()
          for name in _LAYER_IDS}
  return {l: LayerRecord(**{
      name: tuple(v[j]) if name in _DENSE else tuple(e for e in v[j] if e >= 0)
      for name, v in ints.items()}) for j, l in enumerate(moe_layers)}


def link_counts(rec, low_ratio: float = 0.0, plan=None):
  """Per MoE layer of a `cache.step.Record` (numpy): waited fetches (a low-precision one
  counts low_ratio of an expert's bytes), admissions requested, experts prefetched;
  expert-parallel (`plan`): per layer and device [L, N], each copy counted on the device
  that owns its slot."""
  low = rec.actions == FETCH_LOW
  fetch = (rec.actions == FETCH) | low
  size = np.where(low, low_ratio, 1.0)
  adm = rec.admissions >= 0
  if plan is None:
    return (np.sum(fetch * size, axis=-1), np.sum(adm, axis=-1),
            np.sum(rec.prefetched >= 0, axis=-1))
  none = np.zeros(adm.shape[:-1] + (plan.devices,))
  return (per_device(fetch * size, rec.rows, plan.devices),
          per_device(adm, rec.admission_slots, plan.devices), none)


def per_device(weight_LxK, slots_LxK, devices: int) -> np.ndarray:
  """[L, devices]: the weights summed by the device of their global slot (expert-parallel:
  slot s lives on device s mod N; -1, no slot, counts nowhere)."""
  slots = np.asarray(slots_LxK).astype(np.int64)
  on = (slots[..., None] >= 0) & (slots[..., None] % devices == np.arange(devices))
  return np.sum(np.asarray(weight_LxK, np.float64)[..., None] * on, axis=-2)


def prefill_record(tokens: int, moe_layers, copied_LxE, evicted_LxN, expert_bytes: int,
                   wall_s: float) -> TokenRecord:
  """The prompt's record: the experts it fetched (made available) and evicted per layer."""
  rec = TokenRecord(tokens=tokens)
  for j, l in enumerate(moe_layers):
    fetched = tuple(int(e) for e in copied_LxE[j] if e >= 0)
    rec.layers[l] = LayerRecord(fetched=fetched,
                                evicted=tuple(int(e) for e in evicted_LxN[j] if e >= 0))
    rec.fetches += len(fetched)
    rec.evictions += len(rec.layers[l].evicted)
  rec.fetch_bytes = rec.fetches * expert_bytes
  rec.finish(wall_s)
  return rec


RECORDS_KEPT = 1024   # the newest decode records an engine keeps whole (`OffloadEngine.records`)
HEAD_TOKENS = 1024    # the first tokens whose counts a Tally keeps apart (`summary`'s skip)


class Tally:
  """What `summarize` reports of decode records, added up as they come: the running sums
  of STAT_KEYS (and of `device_hits`), the first HEAD_TOKENS tokens' own rows (for
  `summary(skip=...)`) and every token's wall time (8 bytes a token: the exact median).
  A long run's summary costs no record kept."""

  def __init__(self):
    self.walls = array.array("d")
    self.head_TxS: np.ndarray | None = None   # [HEAD_TOKENS, STAT_KEYS + devices]
    self.total_S = self.rest_S = None         # all tokens' sums; those after the head

  tokens = property(lambda self: len(self.walls))

  def add(self, rec: TokenRecord):
    row_S = np.array([rec[k] for k in STAT_KEYS] + list(rec.device_hits), np.float64)
    if self.head_TxS is None:
      self.head_TxS = np.zeros((HEAD_TOKENS, row_S.size))
      self.total_S, self.rest_S = np.zeros_like(row_S), np.zeros_like(row_S)
    if self.tokens < HEAD_TOKENS:
      self.head_TxS[self.tokens] = row_S
    else:
      self.rest_S += row_S
    self.total_S += row_S
    self.walls.append(rec.wall_s)

  def sums(self, skip: int) -> np.ndarray:
    """The sums over the tokens after the first `skip` (at most HEAD_TOKENS)."""
    if skip == 0:
      return self.total_S
    if skip < 0:
      raise ValueError(f"skip={skip}: the tokens to leave out, 0 or more")
    if skip > HEAD_TOKENS:
      raise ValueError(f"skip={skip}: the counts of the first {HEAD_TOKENS} tokens are kept "
                       f"apart, no more; skip at most {HEAD_TOKENS}")
    out_S = np.zeros_like(self.total_S)
    for row_S in self.head_TxS[skip:min(self.tokens, HEAD_TOKENS)]:
      out_S += row_S                # in token order, as a sum over the records
    return out_S + self.rest_S


class Kept:
  """An engine's decode records, bounded: each step's packed decisions until they are
  read or RECORDS_KEPT wait, then every step counted into `tally` and the newest
  RECORDS_KEPT kept whole in `whole` (per-layer decisions built for those only).
  `make(packed, wall_s, waits, layers=...)` builds one step's TokenRecord."""

  def __init__(self):
    self.unbuilt: list[tuple] = []     # (packed Record, wall_s, waits) per step
    self.whole = collections.deque(maxlen=RECORDS_KEPT)
    self.tally = Tally()

  def add(self, step: tuple, make):
    self.unbuilt.append(step)
    if len(self.unbuilt) >= RECORDS_KEPT:
      self.build(make)

  def build(self, make) -> "Kept":
    whole_from = len(self.unbuilt) - RECORDS_KEPT
    for i, step in enumerate(self.unbuilt):
      rec = make(*step, layers=i >= whole_from)
      self.tally.add(rec)
      if i >= whole_from:
        self.whole.append(rec)
    self.unbuilt.clear()
    return self

  def take(self, make) -> list[TokenRecord]:
    """The records kept whole, handed over; the tally started afresh."""
    out = list(self.build(make).whole)
    self.whole.clear()
    self.tally = Tally()
    return out


def tally(records: list[TokenRecord]) -> Tally:
  out = Tally()
  for r in records:
    out.add(r)
  return out


def summarize(records: list[TokenRecord], cfg: ModelConfig) -> dict:
  """Means per token over decode records, plus rates."""
  return summary(tally(records), cfg)


def summary(t: Tally, cfg: ModelConfig, skip: int = 0) -> dict:
  """Means per token over the tokens of `t` after the first `skip`, plus rates."""
  n = t.tokens - skip
  if n <= 0:
    return {"tokens": 0}
  sums_S = t.sums(skip)
  tot = dict(zip(STAT_KEYS, sums_S.tolist()))
  calls = max(tot["expert_calls"], 1.0)
  moe_layers = max(1, len(cfg.moe_layers))
  s = {"tokens": n}
  s.update({f"{k}_per_token": tot[k] / n for k in COUNT_KEYS})
  s.update({f"{k[:-2]}_ms_per_token": 1e3 * tot[k] / n for k in TIME_KEYS})
  s["tpot_ms"] = 1e3 * tot["wall_s"] / n
  s["tpot_median_ms"] = 1e3 * float(np.median(np.frombuffer(t.walls)[skip:]))
  s["hit_rate"] = tot["hits"] / calls
  if sums_S.size > len(STAT_KEYS):     # expert-parallel: each device's share of the calls
    s["device_hit_rates"] = [float(h) / calls for h in sums_S[len(STAT_KEYS):]]
  s["substituted_call_pct"] = 100.0 * tot["substituted"] / calls
  s["substituted_mass_per_token_layer"] = tot["substituted_mass"] / (n * moe_layers)
  s["substituted_mass_per_token"] = tot["substituted_mass"] / n
  s["recall_at_k"] = (tot["recall_hits"] / tot["predicted_calls"] if tot["predicted_calls"]
                      else None)
  return s


TIME_ROWS = (("waiting for fetches", "wait"), ("waiting for admissions", "admission_wait"),
             ("waiting for prefetches", "prefetch_wait"), ("host expert compute", "host"),
             ("compute (rest)", "compute"))


def time_rows(s: dict, link_desc: str) -> list[tuple[str, str]]:
  """"time per token" and, indented under it, every part of it (they add up to it:
  `TokenRecord.finish`); the prefetch wait only where prefetch ran or waited."""
  prefetched = s.get("recall_at_k") is not None or s.get("prefetch_wait_ms_per_token")
  return [("time per token", f"{s['tpot_ms']:.2f} ms  (link: {link_desc})")] + [
      (f"  {label}", f"{s[f'{key}_ms_per_token']:.2f} ms") for label, key in TIME_ROWS
      if key != "prefetch_wait" or prefetched]


def format_stats(s: dict, link_desc: str) -> str:
  """A terminal table of a `summarize` result; times name the link."""
  if not s.get("tokens"):
    return "no decoded tokens"
  rows = [
      ("decode steps", f"{s['tokens']}  (the tokens after the first, which comes from the "
                       "prompt pass; the figures below are per decode step)"),
  ] + time_rows(s, link_desc) + [
      ("expert calls / token", f"{s['expert_calls_per_token']:.1f}"),
      ("hit rate", f"{100 * s['hit_rate']:.1f} %" + (
          "  (union; per device: " + ", ".join(f"{100 * h:.1f}" for h in s["device_hit_rates"])
          + " %)" if s.get("device_hit_rates") else "")),
      ("misses / token", f"{s['misses_per_token']:.2f}"),
      ("sync fetches / token", f"{s['fetches_per_token']:.2f} "
                               + (f"+ {s['fetches_low_per_token']:.2f} low-precision "
                                  if s.get("fetches_low_per_token") else "")
                               + f"({s['fetch_bytes_per_token'] / 1e6:.3f} MB)"),
      ("substituted calls", f"{s['substituted_call_pct']:.1f} % of expert calls"),
      ("substituted mass", f"{s['substituted_mass_per_token_layer']:.4f} per token-layer, "
                           f"{s['substituted_mass_per_token']:.4f} per token"),
      ("dropped / host calls per token", f"{s['dropped_per_token']:.2f} / "
                                         f"{s['host_calls_per_token']:.2f}"),
      ("admissions / evictions per token", f"{s['admissions_per_token']:.2f} / "
                                           f"{s['evictions_per_token']:.2f}"),
  ]
  if s.get("recall_at_k") is not None:
    rows += [
        ("prefetches / token", f"{s['prefetches_per_token']:.2f} requested, "
                               f"{s['useful_prefetches_per_token']:.2f} executed"),
        ("prefetch recall@k", f"{100 * s['recall_at_k']:.1f} %"),
        ("wasted prefetch bytes / token", f"{s['wasted_bytes_per_token'] / 1e6:.3f} MB"),
    ]
  if "staged_reads" in s:     # the host staging tier's reads (`io.staging.StagingCache`)
    rows.append(("host staging (since built)", staging.describe(s)))
  w = max(len(a) for a, _ in rows)
  return "\n".join([f"{a.ljust(w)}  {b}" for a, b in rows] + ["(MB = 10^6 bytes)"])
