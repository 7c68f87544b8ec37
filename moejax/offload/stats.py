"""Per-token records of the offload engine, their summary and its table.

A `TokenRecord` holds one decoded token's counts (summed over MoE layers) and
times, and per MoE layer a `LayerRecord` of what was decided and done there.
Inserts are attributed to the token and layer where they logically take effect
(an admission requested at token t for layer l: before layer l at token t+1),
however early the engine really made them, so records do not depend on thread
timing.  Masses are normalised shares g / sum(selected g).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import ModelConfig
from moejax.offload.policy import DROP, HIT, HOST, SUBSTITUTE

COUNT_KEYS = ("expert_calls", "hits", "misses", "fetches", "fetch_bytes", "substituted",
              "substituted_mass", "dropped", "dropped_mass", "host_calls", "admissions",
              "admitted", "evictions", "prefetches", "useful_prefetches", "prefetch_bytes",
              "wasted_bytes", "recall_hits", "predicted_calls")
TIME_KEYS = ("wait_s", "admission_wait_s", "prefetch_wait_s", "host_s", "compute_s", "wall_s")
STAT_KEYS = COUNT_KEYS + TIME_KEYS


@dataclasses.dataclass(slots=True)
class LayerRecord:
  """One MoE layer of one token.  Expert ids; actions are policy.HIT/FETCH/...
  Lists while the token is decoded, tuples in the finished record (`freeze`).

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
  ids: list[int] = dataclasses.field(default_factory=list)
  actions: list[int] = dataclasses.field(default_factory=list)
  substitutes: list[int] = dataclasses.field(default_factory=list)
  fetched: list[int] = dataclasses.field(default_factory=list)
  admissions: list[int] = dataclasses.field(default_factory=list)
  admitted: list[int] = dataclasses.field(default_factory=list)
  evicted: list[int] = dataclasses.field(default_factory=list)
  predicted: list[int] = dataclasses.field(default_factory=list)
  prefetched: list[int] = dataclasses.field(default_factory=list)
  true_ids: list[int] = dataclasses.field(default_factory=list)

  def freeze(self):
    """The token is done: lists become tuples (of ints, which the garbage collector
    stops scanning, so a long run's records do not slow its collections)."""
    for name in self.__slots__:
      setattr(self, name, tuple(getattr(self, name)))


@dataclasses.dataclass
class TokenRecord:
  """One token's counts (over MoE layers) and seconds; `record["hits"]` reads a field."""
  expert_calls: float = 0.0
  hits: float = 0.0
  misses: float = 0.0
  fetches: float = 0.0
  fetch_bytes: float = 0.0
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
  layers: dict[int, LayerRecord] = dataclasses.field(default_factory=dict)

  def __getitem__(self, key: str):
    return getattr(self, key)

  def layer(self, l: int) -> LayerRecord:
    return self.layers.setdefault(l, LayerRecord())

  def count_decision(self, l: int, action: np.ndarray, ids: np.ndarray, exec_ids: np.ndarray,
                     gates: np.ndarray):
    """Adds one layer's decision (K actions, ids, executed ids and gate weights)."""
    act = action.tolist()
    self.expert_calls += len(act)
    hits = act.count(HIT)
    self.hits += hits
    self.misses += len(act) - hits
    rec = self.layer(l)
    rec.ids, rec.actions = ids.tolist(), act
    if hits == len(act):      # all hits: nothing substituted, dropped or on the host
      rec.substitutes = [-1] * len(act)
      return
    g = gates.tolist()
    total = max(sum(g), 1e-20)
    self.substituted += act.count(SUBSTITUTE)
    self.substituted_mass += sum(w for a, w in zip(act, g) if a == SUBSTITUTE) / total
    self.dropped += act.count(DROP)
    self.dropped_mass += sum(w for a, w in zip(act, g) if a == DROP) / total
    self.host_calls += act.count(HOST)
    rec.substitutes = [int(e) if a == SUBSTITUTE else -1 for a, e in zip(act, exec_ids.tolist())]

  def finish(self, wall_s: float):
    """Counts the evictions (the layers' evicted ids) and splits the wall time."""
    self.evictions = float(sum(len(r.evicted) for r in self.layers.values()))
    self.admitted = float(sum(len(r.admitted) for r in self.layers.values()))
    for r in self.layers.values():
      r.freeze()
    self.wall_s = wall_s
    self.compute_s = (wall_s - self.wait_s - self.admission_wait_s - self.prefetch_wait_s
                      - self.host_s)


def summarize(records: list[TokenRecord], cfg: ModelConfig) -> dict:
  """Means per token over decode records, plus rates."""
  n = len(records)
  if n == 0:
    return {"tokens": 0}
  tot = {k: float(sum(r[k] for r in records)) for k in STAT_KEYS}
  calls = max(tot["expert_calls"], 1.0)
  moe_layers = max(1, len(cfg.moe_layers))
  s = {"tokens": n}
  s.update({f"{k}_per_token": tot[k] / n for k in COUNT_KEYS})
  s.update({f"{k[:-2]}_ms_per_token": 1e3 * tot[k] / n for k in TIME_KEYS})
  s["tpot_ms"] = 1e3 * tot["wall_s"] / n
  s["tpot_median_ms"] = 1e3 * float(np.median([r.wall_s for r in records]))
  s["hit_rate"] = tot["hits"] / calls
  s["substituted_call_pct"] = 100.0 * tot["substituted"] / calls
  s["substituted_mass_per_token_layer"] = tot["substituted_mass"] / (n * moe_layers)
  s["substituted_mass_per_token"] = tot["substituted_mass"] / n
  s["recall_at_k"] = (tot["recall_hits"] / tot["predicted_calls"] if tot["predicted_calls"]
                      else None)
  return s


def format_stats(s: dict, link_desc: str) -> str:
  """A terminal table of a `summarize` result; times name the link."""
  if not s.get("tokens"):
    return "no decoded tokens"
  rows = [
      ("tokens decoded", f"{s['tokens']}"),
      ("time per token", f"{s['tpot_ms']:.2f} ms  (link: {link_desc})"),
      ("  waiting for fetches", f"{s['wait_ms_per_token']:.2f} ms"),
      ("  waiting for admissions", f"{s['admission_wait_ms_per_token']:.2f} ms"),
      ("  host expert compute", f"{s['host_ms_per_token']:.2f} ms"),
      ("  compute (rest)", f"{s['compute_ms_per_token']:.2f} ms"),
      ("expert calls / token", f"{s['expert_calls_per_token']:.1f}"),
      ("hit rate", f"{100 * s['hit_rate']:.1f} %"),
      ("misses / token", f"{s['misses_per_token']:.2f}"),
      ("sync fetches / token", f"{s['fetches_per_token']:.2f} "
                               f"({s['fetch_bytes_per_token'] / 2**20:.3f} MiB)"),
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
        ("waiting for prefetches", f"{s['prefetch_wait_ms_per_token']:.2f} ms"),
        ("prefetches / token", f"{s['prefetches_per_token']:.2f} requested, "
                               f"{s['useful_prefetches_per_token']:.2f} executed"),
        ("prefetch recall@k", f"{100 * s['recall_at_k']:.1f} %"),
        ("wasted prefetch bytes / token", f"{s['wasted_bytes_per_token'] / 2**20:.3f} MiB"),
    ]
  w = max(len(a) for a, _ in rows)
  return "\n".join(f"{a.ljust(w)}  {b}" for a, b in rows)
