"""The engine's prompt pass through one MoE layer, after its attention and router.

The union of the experts the prompt selected is made available: the missing ones are
fetched in one batch and passed to the layer's expert call as extra rows after the
slots; then they are inserted, most used first, never evicting an expert the prompt
hit, the usage counts are updated for the whole prompt, and a layer with staging slots
is trimmed back to its budget.  Exact for every policy.
"""

from __future__ import annotations

import time

import numpy as np

from moejax.offload import resident as resident_lib
from moejax.offload import steps as steps_lib
from moejax.offload import tickets as tickets_lib
from moejax.offload.stats import TokenRecord
from moejax.sampler import bucket


def moe_layer(i: int, st, p, h, moe_in, ids, gates, t: int, *, slots, prefetcher, physical: int,
              policy, trim_to, put, rec: TokenRecord):
  """Layer i's experts for the prompt's t real positions (of ids' padded length); returns
  the layer output and updates `slots.states[i]` and `rec`."""
  state = slots.states[i]
  num_e, k = slots.num_experts, slots.top_k
  ids_np = np.asarray(ids)
  valid = ids_np[:t]
  counts = np.bincount(valid.reshape(-1), minlength=num_e).astype(np.float32)
  used = np.flatnonzero(counts)
  exp_slot = np.asarray(state.expert_slot)
  missing = sorted((int(e) for e in used if exp_slot[e] < 0), key=lambda e: (-counts[e], e))
  fb = bucket(max(1, len(missing)), minimum=k)
  extra = slots.zero_rows
  if missing:
    tickets, _ = prefetcher.fetch(i, missing, pad_to=fb)
    tw = time.perf_counter()
    extra = tickets_lib.wait_stacked(tickets, fb, timeout=slots.timeout_s)
    rec.wait_s += time.perf_counter() - tw
    rec.fetch_bytes += sum(tk.nbytes for tk in tickets)
  rec.fetches += len(missing)
  rec.layer(i).fetched = missing
  hits = int(np.sum(exp_slot[valid.reshape(-1)] >= 0))
  rec.expert_calls += valid.size
  rec.hits += hits
  rec.misses += valid.size - hits
  idx_map = exp_slot.copy()
  for j, e in enumerate(missing):
    idx_map[e] = physical + 1 + j          # after the slots and the scratch row
  pad_ids = np.where(np.arange(len(ids_np))[:, None] < t, ids_np, ids_np[:1])  # token 0's
  x = st.prefill_moe(p, h, moe_in, put(idx_map[pad_ids].astype(np.int32)), gates,
                     state.buffers, extra)
  in_use = np.zeros(num_e, bool)
  in_use[used] = exp_slot[used] >= 0               # never evict an expert the prompt hit
  if missing:
    slots.evicted.extend((i, e) for e in slots.insert(i, missing, extra, in_use))
  slots.states[i] = steps_lib.prefill_usage(slots.states[i], put(counts),
                                            float(policy.lfu_decay) ** t)
  if trim_to is not None:
    slots.states[i], ev = resident_lib.trim_jit(slots.states[i], trim_to, policy.cache)
    slots.evicted.append((i, ev))
  return x
