"""Routing locality: how well a plain expert cache does on a model's own routing.

This measures a property of the *model*, not of an offloading policy: per MoE layer, a
cache of C experts serves the router's top-k selections token by token; a selected
expert already in the cache is a hit, every other selection is inserted, evicting the
least recently used (LRU) or least frequently selected (LFU; ties by recency) expert
that the current token does not use.  The same tokens in shuffled order keep the
popularity of each expert but lose temporal locality, so

    locality gain = hit rate (document order) - hit rate (shuffled order)

separates "the same experts keep being chosen within a document" from "a few experts
are popular".  Offloading policies (substitution, admission, ...) are measured by the
emulator and the simulator; this module is the reference curve they are read against.
"""

from __future__ import annotations

import numpy as np


def cache_hit_rate(ids_TxLxK: np.ndarray, num_experts: int, capacity: int,
                   eviction: str = "lru") -> np.ndarray:
  """Per-layer hit rate of a C-slot cache over top-k selections, shape [L].

  ids_TxLxK: the router's selected expert ids per token, layer and rank.  The cache
  starts empty; cold misses count as misses.  All layers advance together (vectorised
  over L), each with its own cache.
  """
  if eviction not in ("lru", "lfu"):
    raise ValueError(f"eviction must be 'lru' or 'lfu', got {eviction!r}")
  ids = np.asarray(ids_TxLxK, np.int64)
  t_len, n_layers, k = ids.shape
  if not 1 <= capacity:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  resident_LxE = np.zeros((n_layers, num_experts), bool)
  last_LxE = np.full((n_layers, num_experts), -1.0)
  freq_LxE = np.zeros((n_layers, num_experts))
  rows = np.arange(n_layers)[:, None]
  hits = np.zeros(n_layers)
  for t in range(t_len):
    sel_LxK = ids[t]
    in_use_LxE = np.zeros((n_layers, num_experts), bool)
    in_use_LxE[rows, sel_LxK] = True
    hits += (resident_LxE & in_use_LxE).sum(1)
    new_LxE = in_use_LxE & ~resident_LxE
    overflow_L = resident_LxE.sum(1) + new_LxE.sum(1) - capacity
    if (overflow_L > 0).any():
      # eviction key: lower = evicted first; experts in use or absent are never chosen
      key = last_LxE if eviction == "lru" else freq_LxE * (t_len + 1.0) + last_LxE
      key = np.where(resident_LxE & ~in_use_LxE, key, np.inf)
      order_LxE = np.argsort(key, axis=1, kind="stable")
      rank_LxE = np.empty_like(order_LxE)
      rank_LxE[rows, order_LxE] = np.arange(num_experts)[None, :]
      evict_LxE = (rank_LxE < np.maximum(overflow_L, 0)[:, None]) & resident_LxE & ~in_use_LxE
      resident_LxE &= ~evict_LxE
    # when the budget is below k, only the first `capacity` selections stay resident
    resident_LxE |= new_LxE
    excess_L = resident_LxE.sum(1) - capacity
    if (excess_L > 0).any():
      for l in np.nonzero(excess_L > 0)[0]:
        drop = [e for e in sel_LxK[l][::-1] if resident_LxE[l, e]][:excess_L[l]]
        resident_LxE[l, drop] = False
    last_LxE[in_use_LxE] = t
    freq_LxE += in_use_LxE
  return hits / (t_len * k)


def locality_curve(ids_TxLxK: np.ndarray, num_experts: int,
                   fractions=(0.0625, 0.125, 0.25, 0.5), evictions=("lru", "lfu"),
                   seed: int = 0) -> dict:
  """Hit rates (mean over layers and per layer) in document and shuffled order.

  Returns {eviction: {fraction: {"ordered": mean, "shuffled": mean,
  "ordered_per_layer": [...], "shuffled_per_layer": [...]}}}.  The shuffle is one fixed
  permutation of the tokens (all layers together), so popularity is unchanged.
  """
  ids = np.asarray(ids_TxLxK)
  perm = np.random.default_rng(seed).permutation(ids.shape[0])
  out: dict = {}
  for ev in evictions:
    out[ev] = {}
    for f in fractions:
      cap = max(1, int(round(f * num_experts)))
      o = cache_hit_rate(ids, num_experts, cap, ev)
      s = cache_hit_rate(ids[perm], num_experts, cap, ev)
      out[ev][f] = {"capacity": cap, "ordered": float(o.mean()), "shuffled": float(s.mean()),
                    "ordered_per_layer": [float(x) for x in o],
                    "shuffled_per_layer": [float(x) for x in s]}
  return out


def load_shares(ids_TxLxK: np.ndarray, num_experts: int) -> np.ndarray:
  """Share of each layer's selections that went to each expert, shape [L, E]."""
  ids = np.asarray(ids_TxLxK)
  counts = np.stack([np.bincount(ids[:, l].reshape(-1), minlength=num_experts)
                     for l in range(ids.shape[1])])
  return counts / counts.sum(1, keepdims=True)
