"""Which slot an insertion overwrites: the eviction order of one layer's cache (pure,
jittable; `resident.insert` and `resident.trim` read it, so the engine, the emulator and
the simulator share it).

Eviction picks, among slots not in use by the current token, an empty slot
first, else `lru` (oldest last use) or `lfu` (smallest decayed selection count,
ties broken by lru, then by the lowest slot) or `least_stale` (below).  The LFU
count is `policy.update_usage`'s decayed count of router selections.

`least_stale` is SpecMD's Least-Stale eviction (D. Hoang, A. Jaiswal, M. Samragh,
M. Cho, "SpecMD: A Comprehensive Study On Speculative Expert Prefetching",
arXiv:2602.03921, 2026).  The abstract calls it a hybrid of temporal and spatial
locality that cuts "collision misses" up to 85x against LRU under prefetch; its
method section was not in the stored copies we could search, so the rule here is
the two-generation reading that public re-implementations citing the paper share
(e.g. tinyserve's LeastStalePolicy): an expert touched in the current
forward pass is *fresh*, one touched only in earlier passes is *stale*; stale
experts go before fresh ones, and within a generation first in, first out.  Here
each MoE layer has a cache of its own and a forward pass visits a layer once per
token, so for one layer's cache, exactly:

  pass       one `step.policy_step` of the layer (one decode token, or a whole prompt);
  touch      the expert is inserted (fetch, admission, kept prefetch, prompt) or
             computed on the device from its slot (hit or substitute): the
             `last_used` step lru keeps;
  stale      every resident not touched in the current pass (experts the current
             token uses are protected anyway); the stale go in the order they went
             stale, i.e. increasing `last_used`;
  FIFO       within one generation (equal `last_used`) the expert loaded first
             (smallest `ResidentState.loaded`, the step of its last insertion)
             goes first, then the lowest slot.

So `least_stale` orders victims by (last_used, loaded, slot) where lru orders them
by (last_used, slot): with one pass per token and layer the generations coincide
with lru's last-use order, and the two rules differ where several experts share a
last use (a token's K experts, a prompt's experts), which lru breaks by slot
number and least_stale by load age.  SpecMD's collisions need prefetches and
demand fetches competing for one pool; moejax's speculative prefetch reads its own
rows (`prefetch.view`) and enters the cache only once executed, so they cannot
happen here (docs/simulator.md compares the rules on traces).
"""

from __future__ import annotations

import jax.numpy as jnp

from moejax.cache.policy import CacheParams, PolicyParams, cache_params


def eviction_rank(resident, protected_S: jax.Array, params: CacheParams | PolicyParams):
  """Each slot's position in `eviction_order` [S], and how many may be overwritten:
  the number of slots whose keys (protected, freq [lfu], last use, load step
  [least_stale], slot) come before its own (S x S comparisons; many times faster than
  XLA's sort on CPU at cache sizes)."""
  params = cache_params(params)
  slot_e = resident.slot_expert
  e = jnp.maximum(slot_e, 0)
  empty = slot_e < 0
  last = jnp.where(empty, -2, resident.last_used[e])    # never-used resident: -1
  idx = jnp.arange(slot_e.shape[0])
  # before[i, j]: slot j comes before slot i; keys compared from the least significant up
  before = idx[None, :] < idx[:, None]
  if params.eviction == "least_stale":   # FIFO within a generation: loaded first goes first
    loaded = jnp.where(empty, -2, resident.loaded[e])
    before = (loaded[None, :] < loaded[:, None]) | ((loaded[None, :] == loaded[:, None]) & before)
  before = (last[None, :] < last[:, None]) | ((last[None, :] == last[:, None]) & before)
  if params.eviction == "lfu":
    freq = jnp.where(empty, -jnp.inf, resident.freq[e])
    before = (freq[None, :] < freq[:, None]) | ((freq[None, :] == freq[:, None]) & before)
  prot = protected_S.astype(bool)
  before = (~prot[None, :] & prot[:, None]) | ((prot[None, :] == prot[:, None]) & before)
  return jnp.sum(before, axis=1, dtype=jnp.int32), jnp.sum(~prot)


def eviction_order(resident, protected_S: jax.Array, params: CacheParams | PolicyParams):
  """Slots in the order insertions overwrite them, and how many may be overwritten.

  Empty slots first, then per the eviction policy (lru: oldest last use; lfu:
  smallest decayed count, ties by oldest use; least_stale: oldest last use, ties by
  oldest load), ties by the lowest slot;
  protected slots (in use by the current token) last and never overwritten.
  Inserting J experts one after another, each protecting the one before,
  overwrites exactly the first J slots of this order (the lexicographic order of
  `eviction_rank`'s keys: the same permutation as a lexsort).
  """
  rank, usable = eviction_rank(resident, protected_S, params)
  idx = jnp.arange(rank.shape[0], dtype=jnp.int32)
  # the inverse permutation by one-hot compares (a scatter is a loop of its own on XLA CPU)
  order = jnp.sum(jnp.where(rank[None, :] == idx[:, None], idx[None, :], 0), axis=1)
  return order.astype(jnp.int32), usable


def victim_slot(resident, protected_S: jax.Array,
                params: CacheParams | PolicyParams) -> jax.Array:
  """The slot the next insertion overwrites (see `eviction_order`); -1 if all protected."""
  order, usable = eviction_order(resident, protected_S, params)
  return jnp.where(usable > 0, order[0], -1)
