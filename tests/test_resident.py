"""ResidentState: budget accounting, donated slot insertion, eviction, initial contents."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cache import initial as IN
from moejax.cache import policy as P
from moejax.cache import resident as R

E, I, D = 8, 4, 6
SPEC = {"gate_up": ((2 * I, D), jnp.float32), "down": ((D, I), jnp.float32)}
HOST = {e: {"gate_up": np.full((2 * I, D), e + 1, np.float32),
            "down": np.full((D, I), -(e + 1), np.float32)} for e in range(E)}
LRU = P.CacheParams(eviction="lru")
K = 2


def insert(state, ids, in_use=(), params=LRU):
  ids = list(ids) + [-1] * (K - len(ids))
  rows = {k: jnp.asarray(np.stack([HOST[max(e, 0)][k] for e in ids])) for k in HOST[0]}
  mask = np.zeros(E, bool)
  mask[list(in_use)] = True
  return R.insert_jit(state, jnp.asarray(ids, jnp.int32), rows, jnp.asarray(mask), params)


def check_consistent(state):
  se, es = np.asarray(state.slot_expert), np.asarray(state.expert_slot)
  for s, e in enumerate(se):
    if e >= 0:
      assert es[e] == s
      chex.assert_trees_all_equal(jax.tree.map(lambda b: b[s], state.buffers), HOST[e])
  for e, s in enumerate(es):
    if s >= 0:
      assert se[s] == e


def test_budget_slots_staging_and_bytes():
  b = R.make_budget(64, 8, 1000, 8, fraction=0.25)
  assert (b.slots, b.staging, b.physical) == (16, 0, 16)
  assert b.device_bytes == (16 + 1) * 1000 * 8 and not b.all_resident    # + scratch row
  b = R.make_budget(8, 4, 1000, 2, fraction=0.25)         # S = 2 < K = 4: two staging slots
  assert (b.slots, b.staging) == (2, 2)
  assert "2 staging" in b.describe()
  b = R.make_budget(8, 2, 1000, 2, fraction=None, nbytes=5 * 1000 * 2 + 999)
  assert b.slots == 5 and b.as_dict()["slots_per_layer"] == 5
  full = R.make_budget(8, 2, 1000, 2, fraction=1.0)
  assert full.all_resident and full.staging == 0 and "every expert" in full.describe()
  assert R.make_budget(8, 2, 1000, 2, fraction=None, nbytes=10**9).slots == 8


def test_budget_errors_name_the_flag():
  with pytest.raises(R.BudgetError, match="--cache_fraction"):
    R.make_budget(8, 2, 1000, 2, fraction=0.05)             # rounds to 0 slots
  for f in (0.0, -0.5, 1.5):
    with pytest.raises(R.BudgetError, match="--cache_fraction"):
      R.make_budget(8, 2, 1000, 2, fraction=f)
  with pytest.raises(R.BudgetError, match="--cache_bytes"):
    R.make_budget(8, 2, 1000, 2, fraction=None, nbytes=1999)  # under one slot per layer
  with pytest.raises(R.BudgetError, match="--cache_bytes"):
    R.make_budget(8, 2, 1000, 2, fraction=None, nbytes=0)


def test_insert_fills_empty_slots_then_evicts_lru_and_is_donated():
  st = R.init_state(E, 3, SPEC)
  st, ev = insert(st, [4, 2])
  assert list(np.asarray(ev)) == [-1, -1]
  old = st
  st, ev = insert(st, [6])
  assert old.buffers["gate_up"].is_deleted()               # donated: updated in place
  check_consistent(st)
  assert st.resident_experts() == [2, 4, 6]
  # full: the next insertion evicts the least recently used (all inserted at step 0: lowest slot)
  st = jax.tree_util.tree_map(lambda x: x, st)
  import dataclasses
  st = dataclasses.replace(st, last_used=jnp.asarray([0, 0, 5, 0, 3, 0, 9, 0], jnp.int32))
  st, ev = insert(st, [1])
  assert list(np.asarray(ev)) == [4, -1]                    # e4 (t=3) is the oldest
  check_consistent(st)
  assert st.resident_experts() == [1, 2, 6]


def test_in_use_experts_are_never_evicted_and_resident_ones_not_reinserted():
  st = R.init_state(E, 2, SPEC)
  st, _ = insert(st, [0, 1])
  st, ev = insert(st, [5, 6], in_use=[0, 1])                # everything protected: skipped
  assert list(np.asarray(ev)) == [-1, -1] and st.resident_experts() == [0, 1]
  st, ev = insert(st, [5, 6], in_use=[0])                   # 5 evicts 1, then 6 finds 0, 5 in use
  assert list(np.asarray(ev)) == [1, -1]
  assert st.resident_experts() == [0, 5]
  st, ev = insert(st, [5])                                  # already resident: no-op
  assert list(np.asarray(ev)) == [-1, -1] and st.resident_experts() == [0, 5]
  check_consistent(st)


def test_lfu_insertion_evicts_least_frequent():
  import dataclasses
  st = R.init_state(E, 2, SPEC)
  st, _ = insert(st, [0, 1])
  st = dataclasses.replace(st, freq=jnp.asarray([3.0, 1.0, 0, 0, 0, 0, 0, 0]),
                           last_used=jnp.asarray([0, 9, -1, -1, -1, -1, -1, -1], jnp.int32))
  st, ev = insert(st, [2], params=P.CacheParams(eviction="lfu"))
  assert list(np.asarray(ev))[0] == 1                       # lru would have evicted e0
  st2 = R.init_state(E, 2, SPEC)
  st2, _ = insert(st2, [0, 1])
  st2 = dataclasses.replace(st2, last_used=jnp.asarray([0, 9, -1, -1, -1, -1, -1, -1], jnp.int32))
  st2, ev2 = insert(st2, [2], params=LRU)
  assert list(np.asarray(ev2))[0] == 0


def test_slot_buffers_are_owned_copies_and_fill_takes_profile_order():
  src = {e: {k: v.copy() for k, v in HOST[e].items()} for e in range(E)}
  counts = np.array([1, 9, 0, 9, 4, 0, 2, 7])
  order = IN.profile_order(counts)
  assert order[:4] == [1, 3, 7, 4]                          # by count, ties by id
  st = IN.fill(R.init_state(E, 3, SPEC), order, lambda e: src[e], LRU, chunk=K)
  assert st.resident_experts() == [1, 3, 7]
  for e in range(E):                                        # scribble over the host copies
    for v in src[e].values():
      v[...] = 0
  check_consistent(st)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_buffers_hold_each_layers_filled_slots_and_zeros_after(dtype):
  spec = {k: (shp, dtype) for k, (shp, _) in SPEC.items()}
  host = lambda j, e: {k: (v + 10 * j).astype(np.float32) for k, v in HOST[e].items()}
  sets = [[5, 2, -1, 7, 0], [-1, -1, -1, -1, -1], [1, 3, 4, 6, -1]]   # 5 slots a layer
  bufs = IN.stacked_buffers(spec, 5 + 1 + K, sets, host, jax.devices()[0], chunk=3)
  for k, b in bufs.items():
    chex.assert_shape(b, (3, 8) + spec[k][0])
    assert b.dtype == dtype
    for j, slots in enumerate(sets):
      for s in range(8):
        want = (host(j, slots[s])[k] if s < 5 and slots[s] >= 0 else
                np.zeros(spec[k][0], np.float32))
        np.testing.assert_array_equal(np.asarray(b[j, s], np.float32),
                                      np.asarray(jnp.asarray(want, dtype), np.float32))


def test_fill_layer_resolves_auto_all_and_profile():
  budget = R.make_budget(E, K, 100, 1, fraction=1.0)
  assert IN.resolve_initial("auto", budget) == "all"
  with pytest.raises(ValueError, match="initial must be"):
    IN.resolve_initial("most", budget)
  st = IN.fill_layer(R.init_state(E, E, SPEC), 0, "all", budget, HOST.__getitem__, LRU, K)
  assert st.resident_experts() == list(range(E))
  check_consistent(st)
  with pytest.raises(ValueError, match="profile counts for MoE layer 3"):
    IN.fill_layer(R.init_state(E, E, SPEC), 3, "profile", budget, HOST.__getitem__, LRU, K,
                  {0: np.ones(E)})


def test_trim_evicts_back_to_the_budget_in_eviction_order():
  import dataclasses
  st = R.init_state(E, 3, SPEC)                      # S = 1 budget + 2 staging slots
  st, _ = insert(st, [4, 6])
  st, _ = insert(st, [1], in_use=[4, 6])
  st = dataclasses.replace(st, last_used=jnp.asarray([0, 5, 0, 0, 2, 0, 9, 0], jnp.int32),
                           freq=jnp.asarray([0, 1.0, 0, 0, 3.0, 0, 2.0, 0], jnp.float32))
  lru, evicted = R.trim(st, 1, LRU)                  # oldest uses go: e4 (t=2), e1 (t=5)
  assert lru.resident_experts() == [6]
  assert sorted(int(e) for e in np.asarray(evicted) if e >= 0) == [1, 4]
  check_consistent(lru)
  lfu, _ = R.trim(st, 1, P.CacheParams(eviction="lfu"))   # smallest counts go: e1, e6
  assert lfu.resident_experts() == [4]
  check_consistent(lfu)
  same, none = R.trim(st, 3, LRU)                    # within the budget: nothing happens
  assert same.resident_experts() == [1, 4, 6] and (np.asarray(none) < 0).all()
  two, _ = R.trim(st, 2, LRU)
  assert two.resident_experts() == [1, 6]
