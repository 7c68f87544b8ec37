"""SpecMD's Least-Stale eviction (`eviction.eviction_rank`, eviction="least_stale"): which
slot it evicts, by hand and against a lexsort of its keys, and end to end through the
one per-layer function (`cache.step.policy_step`, replayed by the simulator)."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np

from moejax.cache import eviction as EV
from moejax.cache import policy as P
from moejax.cache import resident as R
from moejax.model.config import ModelConfig
from moejax.research import simulator as sim

LRU = P.CacheParams(eviction="lru")
LS = P.CacheParams(eviction="least_stale")


def state_with(resident, num_experts=8, slots=4, last=None, loaded=None, step=0):
  st = R.init_state(num_experts, slots, {}, buffers=False)
  st, _ = R.insert(st, jnp.asarray(resident, jnp.int32), None,
                   jnp.zeros((num_experts,), bool), LRU)
  kw = {}
  if last is not None:
    kw["last_used"] = jnp.asarray(last, jnp.int32)
  if loaded is not None:
    kw["loaded"] = jnp.asarray(loaded, jnp.int32)
  return dataclasses.replace(st, step=jnp.int32(step), **kw)


def test_insert_records_the_load_step():
  st = R.init_state(8, 4, {}, buffers=False)
  st = dataclasses.replace(st, step=jnp.int32(3))
  st, _ = R.insert(st, jnp.asarray([5, 2], jnp.int32), None, jnp.zeros((8,), bool), LS)
  chex.assert_trees_all_equal(st.loaded, jnp.asarray([-1, -1, 3, -1, -1, 3, -1, -1], jnp.int32))
  st = dataclasses.replace(st, step=jnp.int32(7), last_used=st.last_used.at[5].set(6))
  st, _ = R.insert(st, jnp.asarray([5, 1], jnp.int32), None, jnp.zeros((8,), bool), LS)
  # 5 was resident: not reloaded; 1 is new
  chex.assert_trees_all_equal(st.loaded[jnp.asarray([1, 2, 5])], jnp.asarray([7, 3, 3]))


def test_ties_in_last_use_go_to_the_oldest_load_not_the_lowest_slot():
  # slots hold e0..e3; e1 and e2 share the oldest last use (t=2); e1 (slot 1) was loaded
  # at t=2, e2 (slot 2) at t=0: lru takes slot 1, least-stale the older load, slot 2
  st = state_with([0, 1, 2, 3], last=[4, 2, 2, 6, -1, -1, -1, -1],
                  loaded=[1, 2, 0, 5, -1, -1, -1, -1], step=6)
  none = jnp.zeros((4,), bool)
  assert int(EV.victim_slot(st, none, LRU)) == 1
  assert int(EV.victim_slot(st, none, LS)) == 2
  order, usable = EV.eviction_order(st, none, LS)
  assert np.asarray(order).tolist() == [2, 1, 0, 3] and int(usable) == 4


def test_stale_goes_before_fresh_however_old_the_load():
  # e3 was touched in the current pass (last use = step 6) though loaded first (t=0); e0,
  # e1 and e2 are stale: all three go before it
  st = state_with([0, 1, 2, 3], last=[4, 3, 5, 6, -1, -1, -1, -1],
                  loaded=[2, 3, 4, 0, -1, -1, -1, -1], step=6)
  order, _ = EV.eviction_order(st, jnp.zeros((4,), bool), LS)
  assert np.asarray(order).tolist() == [1, 0, 2, 3]
  # protected slots (the token's experts) stay last and are never overwritten
  order, usable = EV.eviction_order(st, jnp.asarray([True, True, False, False]), LS)
  assert np.asarray(order).tolist()[:2] == [2, 3] and int(usable) == 2
  # empty slots first
  part = state_with([0, 1], slots=4, last=[0, 0, -1, -1, -1, -1, -1, -1],
                    loaded=[1, 0, -1, -1, -1, -1, -1, -1])
  assert int(EV.victim_slot(part, jnp.zeros((4,), bool), LS)) == 2


def test_order_is_the_lexicographic_order_of_its_keys():
  # (protected, last use, load step, slot), ascending, empty slots first, against lexsort
  rng = np.random.default_rng(1)
  for trial in range(40):
    slots, num_e = 6, 12
    res = rng.choice(num_e, size=rng.integers(0, slots + 1), replace=False)
    st = state_with([int(e) for e in res], num_experts=num_e, slots=slots,
                    last=rng.integers(-1, 3, num_e), loaded=rng.integers(-1, 3, num_e))
    prot = rng.random(slots) < 0.3
    order, usable = EV.eviction_order(st, jnp.asarray(prot), LS)
    se = np.asarray(st.slot_expert)
    empty = se < 0
    last = np.where(empty, -2, np.asarray(st.last_used)[np.maximum(se, 0)])
    loaded = np.where(empty, -2, np.asarray(st.loaded)[np.maximum(se, 0)])
    ref = np.lexsort((np.arange(slots), loaded, last, prot.astype(int)))
    np.testing.assert_array_equal(np.asarray(order), ref, err_msg=f"trial {trial}")
    assert int(usable) == int((~prot).sum())


def test_trim_uses_the_same_order():
  st = state_with([0, 1, 2], slots=3, last=[5, 5, 5, -1, -1, -1, -1, -1],
                  loaded=[4, 1, 3, -1, -1, -1, -1, -1], step=5)
  lru, _ = R.trim(st, 1, LRU)            # all tied: the lowest slots go (e0, e1)
  ls, _ = R.trim(st, 1, LS)              # the oldest loads go (e1 at t=1, e2 at t=3)
  assert lru.resident_experts() == [2] and ls.resident_experts() == [0]


def tiny_cfg():
  return ModelConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=4, top_k=2,
                     moe_intermediate_size=4, intermediate_size=8, sparse_layers=(True,),
                     qk_norm="head", norm_topk_prob=True).validate()


def test_policy_step_evicts_the_older_load_where_lru_takes_the_lower_slot():
  # E=4, K=2, S=2; threshold(0.3) + drop: a second choice of share ~0.45 waits, one of
  # ~0.12 is dropped (touches nothing).  t0 routes (0,1): e0 -> slot 0, e1 -> slot 1.
  # t1 (2,1): e1 hits, e2 evicts e0 into slot 0.  Both now last used at t1, e1 loaded at
  # t0, e2 at t1.  t2 (3,0): e3 waits, e0 is dropped: lru evicts slot 0 (e2), least-stale
  # the older load (e1).
  lg = np.full((3, 1, 4), -10.0, np.float32)
  for t, (a, b, gb) in enumerate([(0, 1, 1.8), (2, 1, 1.8), (3, 0, 0.0)]):
    lg[t, 0, a], lg[t, 0, b] = 2.0, gb
  pols = [P.make_policy("threshold", tau=0.3, substitution="drop", eviction=ev)
          for ev in ("lru", "least_stale")]
  lru, ls = sim.simulate(tiny_cfg(), lg, pols, cache_fraction=0.5, detail=True)
  f = sim.STAT_FIELDS
  for r in (lru, ls):
    np.testing.assert_array_equal(r.detail["stats"][:, 0, f.index("fetches")], [2, 1, 1])
    np.testing.assert_array_equal(r.detail["stats"][:, 0, f.index("dropped")], [0, 0, 1])
    assert sorted(r.detail["resident"][1, 0].tolist()) == [1, 2]
  assert sorted(lru.detail["resident"][-1, 0].tolist()) == [1, 3]
  assert sorted(ls.detail["resident"][-1, 0].tolist()) == [2, 3]


def test_make_policy_and_flag_errors():
  p = P.make_policy("quality", eviction="least_stale")
  assert p.eviction == "least_stale" and "least_stale" in p.describe()
  try:
    P.make_policy("quality", eviction="least-stale")
  except P.PolicyError as e:
    assert str(e).startswith("--eviction") and "least_stale" in str(e)
  else:
    raise AssertionError("a misspelt eviction rule was accepted")
