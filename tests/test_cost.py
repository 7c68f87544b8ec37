"""The low-precision miss rules and the cost-model policy (moejax.cache.cost), by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cache import cost as C
from moejax.cache import policy as P
from moejax.cache import resident as R
from moejax.research import simulator as sim
from tests.test_simulator import tiny_cfg

MODEL = C.CostModel(full_ms=1.0, low_ms=0.5, sub_slope=10.0, low_slope=1.0, drop_slope=20.0)


def test_choose_by_hand():
  share = jnp.asarray([0.1, 0.01, 0.5])
  # lam 1, share 0.1: full 1, low 0.5 + 0.1 = 0.6, sub 1.0, drop 2.0 -> low;
  # share 0.01: sub 0.1 -> sub; share 0.5: full 1, low 1.0 (a tie: the better quality), sub 5
  np.testing.assert_array_equal(C.choose(MODEL, 1.0, share), [C.LOW, C.SUB, C.FULL])
  # lam 0: time only; substitution is free
  np.testing.assert_array_equal(C.choose(MODEL, 0.0, share), [C.SUB] * 3)
  # lam 100: every full fetch (quality cost 0) beats low (>= 1 + 0.5)
  np.testing.assert_array_equal(C.choose(MODEL, 100.0, share), [C.FULL] * 3)
  # host compute at 0.3 ms beats waiting when it is profiled
  host = C.CostModel(1.0, 0.5, 10.0, 1.0, 20.0, host_ms=0.3)
  np.testing.assert_array_equal(C.choose(host, 100.0, share), [C.HOST] * 3)
  # drop cheaper than sub when its slope is
  cheap_drop = C.CostModel(1.0, 0.5, 10.0, 1.0, 5.0)
  np.testing.assert_array_equal(C.choose(cheap_drop, 1.0, share[1:2]), [C.DROP])
  # jittable with a traced lam
  np.testing.assert_array_equal(jax.jit(lambda l: C.choose(MODEL, l, share))(1.0),
                                [C.LOW, C.SUB, C.FULL])


def test_from_profile_times():
  m = C.from_profile(9437184, 4725760, 25e9, 10e-6, C.DEMO_SLOPES, bits=8)
  np.testing.assert_allclose(m.full_ms, 1e3 * (10e-6 + 9437184 / 25e9))
  np.testing.assert_allclose(m.low_ms, 1e3 * (10e-6 + 4725760 / 25e9))
  assert m.low_slope == C.DEMO_SLOPES.low8 and m.host_ms is None
  assert C.default_model(4).low_ms < C.default_model(8).low_ms < C.default_model(8).full_ms


def _state(num_e, resident, low=()):
  st = R.init_state(num_e, 4, {}, buffers=False)
  st, _ = R.insert(st, jnp.asarray(resident + [-1] * (4 - len(resident)), jnp.int32), None,
                   jnp.zeros((num_e,), bool), P.CacheParams(),
                   jnp.asarray([e in low for e in resident] + [False] * (4 - len(resident))))
  return st


def test_threshold_low_and_cost_decisions_by_hand():
  cfg = tiny_cfg(num_experts=8, top_k=4)
  # shares ~ (0.60, 0.25, 0.10, 0.05) of experts 0, 1, 2, 3; 5 and 6 resident (6 low)
  g = np.log(np.asarray([0.60, 0.25, 0.10, 0.05]))
  lg = np.full((1, 8), -30.0, np.float32)
  lg[0, :4] = g
  lg[0, 5], lg[0, 6] = g[3] - 1, g[3] - 2
  st = _state(8, [5, 6], low=(6,))
  pol = P.make_policy("threshold_low", tau=0.2, tau_low=0.08)
  d = P.decide(jnp.asarray(lg), st, pol, cfg)
  # first choice and 0.25 >= tau wait in full; 0.10 >= tau_low in low; 0.05 substituted by 5
  np.testing.assert_array_equal(d.action[0], [P.FETCH, P.FETCH, P.FETCH_LOW, P.SUBSTITUTE])
  np.testing.assert_array_equal(d.sub_ids[0], [-1, -1, -1, 5])
  np.testing.assert_array_equal(d.exec_ids[0], [0, 1, 2, 5])
  # cost, lam 1 with MODEL: 0.60 full (1.0 < low 1.1); 0.25 low (0.75 < 1.0); 0.10 low
  # (0.6 < sub 1.0); 0.05 sub (0.5 < low 0.55)
  cost = P.make_policy("cost", lam=1.0, cost=MODEL)
  d = P.decide(jnp.asarray(lg), st, cost, cfg)
  np.testing.assert_array_equal(d.action[0], [P.FETCH, P.FETCH_LOW, P.FETCH_LOW, P.SUBSTITUTE])
  # admission accumulates low fetches and hits on low slots (6 selected: its share)
  st2 = _state(8, [0, 6], low=(6,))
  lg2 = np.full((1, 8), -30.0, np.float32)
  lg2[0, [0, 6, 1, 2]] = g
  d = P.decide(jnp.asarray(lg2), st2, P.make_policy("fetch_low", admission_beta=0.2), cfg)
  np.testing.assert_array_equal(d.action[0], [P.HIT, P.HIT, P.FETCH_LOW, P.FETCH_LOW])
  np.testing.assert_allclose(np.asarray(d.acc)[[0, 6, 1, 2]], [0.0, 0.0, 0.10, 0.05], atol=1e-6)
  assert bool(d.admit[6]) and not bool(d.admit[0])     # 0.25 >= beta: upgrade requested


def _trace(cfg, t=40, seed=0):
  return np.random.default_rng(seed).standard_normal((t, 2, cfg.num_experts)).astype(np.float32)


def test_lambda_zero_never_waits_and_huge_lambda_is_fetch_all():
  cfg = tiny_cfg(num_experts=16, top_k=4, layers=2)
  lg = _trace(cfg)
  zero, huge, base = sim.simulate(
      cfg, lg, [P.make_policy("cost", lam=0.0), P.make_policy("cost", lam=1e9), "fetch_all"],
      detail=True)
  assert zero.total("fetches") == 0 and zero.total("fetches_low") == 0
  assert zero.total("substituted") + zero.total("dropped") == zero.total("misses") > 0
  chex.assert_trees_all_equal(
      {k: huge.detail[k] for k in ("ids", "action", "sub_ids", "resident")},
      {k: base.detail[k] for k in ("ids", "action", "sub_ids", "resident")})
  assert base.total("fetches") > 0
  # lam in between: some of each, and more waiting the larger lam
  mid = sim.simulate(cfg, lg, [P.make_policy("cost", lam=l) for l in (0.3, 3.0)])
  waited = [r.total("fetches") + r.total("fetches_low") for r in mid]
  assert 0 < waited[0] < waited[1] < base.total("fetches") + 1


def test_bad_cost_flags_name_the_flag():
  with pytest.raises(P.PolicyError, match="--lam"):
    P.make_policy("cost", lam=-1.0)
  with pytest.raises(P.PolicyError, match="--low_bits"):
    P.make_policy("fetch_low", low_bits=2)
  with pytest.raises(P.PolicyError, match="--tau_low"):
    P.make_policy("threshold_low", tau_low=0.0)


def test_host_time_is_measured_from_a_number_or_bench_host_json(tmp_path):
  from moejax.cache import cost as cost_lib
  assert cost_lib.measured_host_ms("0.35") == 0.35
  path = tmp_path / "bench_host.json"
  path.write_text('{"host_ms": 0.42, "summary": {}}')
  assert cost_lib.measured_host_ms(str(path)) == 0.42
  for bad in ("0", "-1", str(tmp_path / "missing.json")):
    with pytest.raises(ValueError, match="host_ms"):
      cost_lib.measured_host_ms(bad)
  (tmp_path / "other.json").write_text('{"summary": {}}')
  with pytest.raises(ValueError, match="host_ms"):
    cost_lib.measured_host_ms(str(tmp_path / "other.json"))


def test_a_measured_host_time_offers_the_host_option():
  from moejax.cache import cost as cost_lib
  base = cost_lib.default_model(8)
  assert base.host_ms is None
  share = jnp.array([0.05, 0.5, 0.9])
  assert not bool(jnp.any(cost_lib.choose(base, 1e3, share) == cost_lib.HOST))
  hosted = cost_lib.with_host(base, 0.35)      # cheaper than a full fetch (~0.39 ms)
  assert hosted.host_ms == 0.35 and hosted.full_ms == base.full_ms
  opt = cost_lib.choose(hosted, 1e3, share)    # quality matters: host beats wait-full
  assert opt.tolist() == [cost_lib.LOW, cost_lib.HOST, cost_lib.HOST]   # int8 at a small share
  slow = cost_lib.with_host(base, 50.0)
  assert not bool(jnp.any(cost_lib.choose(slow, 1e3, share) == cost_lib.HOST))
