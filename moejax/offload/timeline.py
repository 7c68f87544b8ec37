"""Cutting `OffloadEngine.trace` timelines into segments (launch/bench_overhead.py).

Each decode step's trace is [(event, layer, perf_counter)] from "start" to "end"
(see `OffloadEngine.decode_step`).  Per MoE layer, "F" if it made a synchronous
fetch, else "N":
  attend call     "attend" -> "decided": taking arrived admissions, the attend/
                  route/decide call (their insert fused) and reading the decision
  host before     "decided" -> "fetch" (F) or -> "moe" (N)
  fetch window    "fetch" -> "arrived" (F); `link time` is the sync fetches' bare
                  transfer time, `queue + overrun` the rest of the window
  after window    "arrived" -> "moe" (F)
  moe call        "moe" -> "moe_done"
  between layers  "moe_done" -> the next MoE layer's "attend" (or "head")
  embed, head     "start" -> the first "attend"; "head" -> "end"
The segments other than the two window parts add up to `total`.
"""

from __future__ import annotations

import collections

SEGMENTS = ("embed", "N attend call", "N host before", "N moe call", "F attend call",
            "F host before", "F fetch window", "F   link time", "F   queue + overrun",
            "F after window", "F moe call", "between layers", "head", "total")


def segments(traces: list, per_fetch_s: float, fetches_per_token: float) -> dict:
  """Mean ms per token of each segment over `traces` (see the module docstring)."""
  acc = collections.defaultdict(float)
  counts = collections.defaultdict(float)
  for tr in traces:
    first = {}
    for ev, l, t in tr:
      first.setdefault((ev, l), t)
    acc["total"] += tr[-1][2] - tr[0][2]
    acc["head"] += tr[-1][2] - first[("head", -1)]
    layers = sorted({l for ev, l, _ in tr if ev == "attend"})
    acc["embed"] += first[("attend", layers[0])] - tr[0][2] if layers else 0.0
    for j, l in enumerate(layers):
      g = lambda ev: first[(ev, l)]
      kind = "F" if ("fetch", l) in first else "N"
      counts[kind] += 1
      acc[f"{kind} attend call"] += g("decided") - g("attend")
      if kind == "F":
        acc["F host before"] += g("fetch") - g("decided")
        acc["F fetch window"] += g("arrived") - g("fetch")
        acc["F after window"] += g("moe") - g("arrived")
      else:
        acc["N host before"] += g("moe") - g("decided")
      acc[f"{kind} moe call"] += g("moe_done") - g("moe")
      nxt = first[("attend", layers[j + 1])] if j + 1 < len(layers) else first[("head", -1)]
      acc["between layers"] += nxt - g("moe_done")
  n = max(1, len(traces))
  out = {k: 1e3 * acc[k] / n for k in SEGMENTS}
  link = 1e3 * per_fetch_s * fetches_per_token
  out["F   link time"] = link
  out["F   queue + overrun"] = out["F fetch window"] - link
  out["F layers per token"] = counts["F"] / n
  out["N layers per token"] = counts["N"] / n
  return out
