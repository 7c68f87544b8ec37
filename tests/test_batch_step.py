"""The per-layer step over a batch (`cache.step` with [B, ...] routers, `policy.decide`):
B tokens of one layer share one cache; the waited experts are the batch's union, each
fetched once and a hit for the batch's other tokens that selected it."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cache import counting as C
from moejax.cache import policy as P
from moejax.cache import resident as R
from moejax.cache import step as S
from moejax.cache.policy import FETCH, FETCH_LOW, HIT, SUBSTITUTE
from tests.test_step import tiny_cfg


def router(ids, gates, scores):
  ids, gates = jnp.asarray(ids, jnp.int32), jnp.asarray(gates, jnp.float32)
  scores = jnp.asarray(scores, jnp.float32)
  return S.Router(scores, ids, gates, scores)


def state_with(resident, freq, num_slots=4, params=P.CacheParams()):
  st = R.init_state(8, num_slots, {}, buffers=False)
  st, _ = R.insert(st, jnp.asarray(resident, jnp.int32), None, jnp.zeros((8,), bool), params)
  return dataclasses.replace(st, freq=jnp.asarray(freq, jnp.float32))


def stat(c, name):
  return float(c[C.STATS.index(name)])


def test_batch_of_three_by_hand():
  """threshold(0.35) + lfu + admission(0.5); slots [e0, e1, e5, empty], freq e0 2, e1 .5,
  e5 1.  Rank scores (all tokens) favour e2 > e3 > e4 > e1 > e0 > e5.
    t0 selects e2 (.7), e4 (.3): e2 missed first choice -> FETCH; e4 (.3 < .35) -> SUBSTITUTE
       by the best candidate resident or fetched now, not selected: e3 (fetched by t1);
    t1 selects e3 (.8), e2 (.2): e3 FETCH; e2 would be substituted, but t0 fetches it: HIT;
    t2 selects e1 (.7), e4 (.3): e1 HIT; e4 SUBSTITUTE by e2 (fetched by t0).
  Fetch insert (every executed expert e1, e2, e3 protected): e2 into the empty slot 3, e3
  evicts e5 (the unprotected slot of least freq; e0 has 2).  Usage: freq <- .98 freq +
  selections over the batch (e2 and e4 twice).  e4's accumulator adds over t0 and t2:
  .3 + .3 >= .5, so e4 is admitted; inserted with nothing protected, it evicts the least
  frequent: e3 (0 + 1) before e1 (.49 + 1), e0 (1.96), e2 (2)."""
  cfg = tiny_cfg()
  pol = P.make_policy("quality", tau=0.35)
  rule = S.Rule(cfg, pol.decision, pol.cache)
  st = state_with([0, 1, 5], [2, .5, 0, 0, 0, 1, 0, 0], params=pol.cache)
  scores = [[.1, .2, .9, .5, .3, .05, 0, 0]] * 3
  r = router([[2, 4], [3, 2], [1, 4]], [[.7, .3], [.8, .2], [.7, .3]], scores)
  new, step = jax.jit(lambda s, r: S.policy_step(rule, s, r, S.Prediction.none(cfg)))(st, r)
  d = step.dec
  np.testing.assert_array_equal(d.action, [[FETCH, SUBSTITUTE], [FETCH, HIT], [HIT, SUBSTITUTE]])
  np.testing.assert_array_equal(d.sub_ids, [[-1, 3], [-1, -1], [-1, 2]])
  np.testing.assert_array_equal(d.exec_ids, [[2, 3], [3, 2], [1, 2]])
  np.testing.assert_allclose(d.weights, [[.7, .3], [.8, .2], [.7, .3]])
  h = step.head
  np.testing.assert_array_equal(h.fetched, [2, -1, 3, -1, -1, -1])
  np.testing.assert_array_equal(h.fetch_slots, [3, -1, 2, -1, -1, -1])
  np.testing.assert_array_equal(h.evicted, [-1, -1, 5, -1, -1, -1])
  np.testing.assert_array_equal(h.rows, [3, 2, 2, 3, 1, 3])
  np.testing.assert_array_equal(h.fetch_low, [False] * 6)
  np.testing.assert_array_equal(h.true_ids, [2, 4, 3, 2, 1, 4])
  np.testing.assert_array_equal(d.admit, np.arange(8) == 4)
  p = step.pending
  np.testing.assert_array_equal(p.admissions, [4, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(p.admission_slots, [2, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(p.admission_evicted, [3, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(new.slot_expert, [0, 1, 4, 2])
  np.testing.assert_array_equal(new.expert_slot, [0, 1, 3, -1, 2, -1, -1, -1])
  np.testing.assert_allclose(new.freq, [1.96, 1.49, 2, 1, 2, .98, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(new.acc, 0.0)           # e4's .6 reset when admitted
  # the step ran at step 0 (used e1, e2, e3; the initial inserts too); the admission is
  # inserted after the usage update, at step 1
  np.testing.assert_array_equal(new.last_used, [0, 0, 0, 0, 1, 0, -1, -1])
  assert int(new.step) == 1                 # one step for the batch
  c = S.step_counts(step, S.Pending.none(6))
  want = dict(expert_calls=6, hits=2, fetches=2, substituted=2, substituted_mass=.6, dropped=0,
              host_calls=0, admissions=1, admitted=0, evictions=1, fetches_low=0,
              first_substituted=0)
  for k, v in want.items():
    assert stat(c, k) == pytest.approx(v, abs=1e-6), k


def test_low_copies_in_a_batch():
  """threshold_low(0.35, 0.1): t0 waits for e2 in full (first choice), t1 would fetch e2's
  low copy (.2): it uses t0's full fetch (HIT); t1's e3 (.8, first) is fetched in full;
  t2 selects e6 (.7, first: FETCH) and e7 (.3 -> FETCH_LOW), t1 has no e7.  An expert
  two tokens want low is fetched once."""
  cfg = tiny_cfg()
  pol = P.make_policy("threshold_low", tau=0.35, tau_low=0.1, admission_beta=0.5)
  rule = S.Rule(cfg, pol.decision, pol.cache)
  st = state_with([0, 1], [0] * 8, params=pol.cache)
  scores = [[.1, .2, .9, .5, .3, .05, .4, .35]] * 4
  r = router([[2, 4], [3, 2], [6, 7], [1, 7]], [[.7, .3], [.8, .2], [.7, .3], [.7, .3]], scores)
  _, step = S.policy_step(rule, st, r, S.Prediction.none(cfg))
  F, L = FETCH, FETCH_LOW
  np.testing.assert_array_equal(step.dec.action, [[F, L], [F, HIT], [F, L], [HIT, HIT]])
  np.testing.assert_array_equal(step.head.fetched, [2, 4, 3, -1, 6, 7, -1, -1])
  np.testing.assert_array_equal(step.head.fetch_low, [0, 1, 0, 0, 0, 1, 0, 0])
  # low mass served: t0's e4, t2's e7 and t3's hit on e7's low copy: .3 each
  np.testing.assert_allclose(np.asarray(step.dec.acc)[[4, 7]], [.3, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(step.dec.admit, np.arange(8) == 7)   # .6 >= .5


def _random_routers(cfg, n, b, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    lg = jnp.asarray(rng.standard_normal((b, cfg.num_experts)) * 2, jnp.float32)
    out.append(S.route(cfg, lg))
  return out


POLICIES = ["baseline", "quality", "speed", "host", "threshold_low", "cost", "substitute_all"]


@pytest.mark.parametrize("name", POLICIES)
def test_one_token_batches_are_the_engines_step(name):
  """A batch of one (valid given, and `step_counts`) is the engine's step of one token
  (no valid, `layer_counts`): the same states, steps and counts, token after token."""
  cfg = tiny_cfg()
  pol = P.make_policy(name) if name != "quality" else P.make_policy(name, admission_beta=.3)
  rule = S.Rule(cfg, pol.decision, pol.cache, trim_to=3)
  st = R.init_state(cfg.num_experts, 5, {}, buffers=False)
  a = b = st
  pa = pb = S.Pending.none(cfg.top_k)
  one = jnp.ones((1,), bool)
  for r in _random_routers(cfg, 12, 1, seed=3):
    a, sa = S.policy_step(rule, a, r, S.Prediction.none(cfg))
    b, sb = S.policy_step(rule, b, r, S.Prediction.none(cfg), None, one)
    chex.assert_trees_all_equal((a, sa), (b, sb))
    np.testing.assert_array_equal(S.layer_counts(sa, pa), S.step_counts(sb, pb, one))
    pa, pb = sa.pending, sb.pending


@pytest.mark.parametrize("name", ["quality", "speed", "threshold_low"])
def test_identical_tokens_are_one_token_but_for_counts(name):
  """B copies of one token: the resident set, evictions and the first row's decision are
  one token's; the other rows hit what the first fetched; selections (LFU counts), the
  admission accumulator and the per-token counts scale by B, fetches do not."""
  cfg = tiny_cfg()
  pol = P.make_policy(name, admission_beta=50.0)          # accumulate, never admit
  rule = S.Rule(cfg, pol.decision, pol.cache)
  nb = 3
  st1 = stb = state_with([0, 1], [0] * 8, num_slots=3, params=pol.cache)
  for r in _random_routers(cfg, 10, 1, seed=5):
    rb = jax.tree_util.tree_map(lambda a: jnp.repeat(a, nb, axis=0), r)
    acc0, freq0, acc1 = stb.acc, stb.freq, st1.acc
    st1, s1 = S.policy_step(rule, st1, r, S.Prediction.none(cfg))
    stb, sb = S.policy_step(rule, stb, rb, S.Prediction.none(cfg))
    chex.assert_trees_all_equal((st1.slot_expert, st1.expert_slot, st1.last_used),
                                (stb.slot_expert, stb.expert_slot, stb.last_used))
    np.testing.assert_array_equal(sb.dec.action[0], s1.dec.action[0])
    np.testing.assert_array_equal(sb.dec.exec_ids, jnp.repeat(s1.dec.exec_ids, nb, axis=0))
    waited = (s1.dec.action[0] == FETCH) | (s1.dec.action[0] == FETCH_LOW)
    np.testing.assert_array_equal(sb.dec.action[1:], np.broadcast_to(
        np.where(waited, HIT, s1.dec.action[0]), (nb - 1, cfg.top_k)))
    np.testing.assert_array_equal(sb.head.evicted[:cfg.top_k], s1.head.evicted)
    sel = jnp.sum(s1.dec.ids[0][:, None] == jnp.arange(8), axis=0)
    np.testing.assert_allclose(stb.freq, freq0 * pol.lfu_decay + nb * sel, rtol=1e-6)
    np.testing.assert_allclose(stb.acc - acc0, nb * (st1.acc - acc1), rtol=1e-5, atol=1e-6)
    c1 = S.layer_counts(s1, S.Pending.none(cfg.top_k))
    cb = S.step_counts(sb, S.Pending.none(nb * cfg.top_k))
    for k in ("expert_calls", "substituted", "substituted_mass", "dropped", "host_calls"):
      assert stat(cb, k) == pytest.approx(nb * stat(c1, k), rel=1e-6), k
    for k in ("fetches", "fetches_low", "evictions"):
      assert stat(cb, k) == stat(c1, k), k
    fetched = stat(c1, "fetches") + stat(c1, "fetches_low")
    assert stat(cb, "hits") == nb * stat(c1, "hits") + (nb - 1) * fetched


def test_inactive_rows_change_nothing():
  cfg = tiny_cfg()
  pol = P.make_policy("quality", admission_beta=0.3)
  rule = S.Rule(cfg, pol.decision, pol.cache, trim_to=3)
  a = b = state_with([0, 1], [0] * 8, num_slots=4, params=pol.cache)
  on = jnp.asarray([True, True, False, True])
  for r in _random_routers(cfg, 10, 4, seed=7):
    keep = jax.tree_util.tree_map(lambda x: x[on], r)
    a, sa = S.policy_step(rule, a, keep, S.Prediction.none(cfg))
    b, sb = S.policy_step(rule, b, r, S.Prediction.none(cfg), None, on)
    chex.assert_trees_all_equal(a, b)
    np.testing.assert_array_equal(sb.dec.action[2], -1)
    np.testing.assert_array_equal(sb.dec.exec_ids[2], -1)
    chex.assert_trees_all_equal(jax.tree_util.tree_map(lambda x: x[on], sb.dec.action),
                                sa.dec.action)
    np.testing.assert_array_equal(S.step_counts(sa, S.Pending.none(6)),
                                  S.step_counts(sb, S.Pending.none(8), on))


def test_batched_step_refuses_speculation():
  cfg = tiny_cfg()
  pol = P.make_policy("quality")
  rule = S.Rule(cfg, pol.decision, pol.cache, speculate=lambda *a: None)
  st = state_with([0, 1], [0] * 8, params=pol.cache)
  with pytest.raises(ValueError, match="batched step"):
    S.policy_step(rule, st, _random_routers(cfg, 1, 2, 0)[0], S.Prediction.none(cfg))
