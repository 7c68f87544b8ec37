"""The policy rules of DESIGN.md, pinned on hand-written router probabilities."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.config import ModelConfig
from moejax.model.families.configs.glm import GlmConfig
from moejax.cache import eviction as EV
from moejax.cache import policy as P
from moejax.cache import resident as R


def cfg_for(num_experts=8, top_k=2, norm=True):
  return ModelConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=num_experts,
                     top_k=top_k, moe_intermediate_size=4, intermediate_size=8,
                     sparse_layers=(True,), norm_topk_prob=norm).validate()


def state_with(resident, num_experts=8, slots=4):
  s = R.init_state(num_experts, slots, {}, buffers=False)
  se = np.full(slots, -1, np.int32)
  es = np.full(num_experts, -1, np.int32)
  for i, e in enumerate(resident):
    se[i], es[e] = e, i
  return dataclasses.replace(s, slot_expert=jnp.asarray(se), expert_slot=jnp.asarray(es))


def logits_of(probs):
  """Router logits whose softmax is `probs` (one token)."""
  p = np.asarray(probs, np.float64)
  assert abs(p.sum() - 1) < 1e-9
  return jnp.asarray(np.log(p)[None], jnp.float32)


# e0 .40, e1 .10, the other six share .50 (each < .10): top-2 = (e0, e1)
P_UNNORM = [0.40, 0.10] + [0.5 / 6] * 6


def test_threshold_compares_normalised_share_and_equal_tau_waits():
  cfg = cfg_for(norm=False)
  st = state_with([5, 6])
  d = P.decide(logits_of(P_UNNORM), st, P.DecideParams("threshold", tau=0.15), cfg)
  assert list(np.asarray(d.ids[0])) == [0, 1]
  g = np.asarray(d.gates[0])
  assert abs(g.sum() - 0.5) < 1e-5                          # gates do not sum to 1
  share = float(np.asarray(d.share[0, 1]))
  assert abs(share - 0.2) < 1e-5 and g[1] < 0.15 <= share
  # raw g = 0.10 < tau, but the share 0.2 >= tau: it waits
  assert list(np.asarray(d.action[0])) == [P.FETCH, P.FETCH]
  # a share exactly equal to tau waits; just above substitutes
  d_eq = P.decide(logits_of(P_UNNORM), st, P.DecideParams("threshold", tau=share), cfg)
  assert int(d_eq.action[0, 1]) == P.FETCH
  above = float(np.nextafter(np.float32(share), np.float32(1)))
  d_up = P.decide(logits_of(P_UNNORM), st, P.DecideParams("threshold", tau=above), cfg)
  assert int(d_up.action[0, 1]) == P.SUBSTITUTE
  assert int(d_up.action[0, 0]) == P.FETCH                    # first choice always waits


def test_normalising_router_share_equals_gate():
  cfg = cfg_for(norm=True)
  d = P.decide(logits_of(P_UNNORM), state_with([]), P.DecideParams("threshold"), cfg)
  np.testing.assert_allclose(np.asarray(d.share), np.asarray(d.gates), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(d.gates[0]), [0.8, 0.2], rtol=1e-5)


@pytest.mark.parametrize("miss,first_action", [("threshold", P.FETCH), ("first_choice", P.FETCH),
                                               ("substitute_all", P.SUBSTITUTE),
                                               ("fetch_all", P.FETCH), ("host", P.HOST)])
def test_first_choice_protection(miss, first_action):
  cfg = cfg_for(top_k=3)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  st = state_with([3, 4])                     # all three selected experts miss
  d = P.decide(logits_of(probs), st, P.DecideParams(miss, tau=1.0), cfg)
  act = list(np.asarray(d.action[0]))
  assert act[0] == first_action
  later = {"threshold": P.SUBSTITUTE, "first_choice": P.SUBSTITUTE,
           "substitute_all": P.SUBSTITUTE, "fetch_all": P.FETCH, "host": P.HOST}[miss]
  # only two unused resident experts (3, 4) for the substituted misses
  if miss in ("threshold", "first_choice"):
    assert act[1:] == [P.SUBSTITUTE, P.SUBSTITUTE]
  elif miss == "substitute_all":
    assert act == [P.SUBSTITUTE, P.SUBSTITUTE, P.DROP]       # ran out of substitutes
  else:
    assert act[1:] == [later, later]


def test_substitutes_are_distinct_best_resident_and_never_selected():
  cfg = cfg_for(top_k=3)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  # e1 is resident and selected (a hit): it must not serve as a substitute
  st = state_with([1, 3, 4, 7])
  d = P.decide(logits_of(probs), st, P.DecideParams("substitute_all"), cfg)
  assert list(np.asarray(d.action[0])) == [P.SUBSTITUTE, P.HIT, P.SUBSTITUTE]
  assert list(np.asarray(d.sub_ids[0])) == [3, -1, 4]       # misses in score order get 3 then 4
  assert list(np.asarray(d.exec_ids[0])) == [3, 1, 4]
  np.testing.assert_allclose(np.asarray(d.weights), np.asarray(d.gates))  # e's own gate weight
  # the first choice is fetched (pending): e2's substitute is the best *resident* expert
  d2 = P.decide(logits_of(probs), st, P.DecideParams("first_choice"), cfg)
  assert list(np.asarray(d2.action[0])) == [P.FETCH, P.HIT, P.SUBSTITUTE]
  assert int(d2.sub_ids[0, 2]) == 3
  used = [int(e) for e in np.asarray(d2.exec_ids[0]) if e >= 0]
  assert len(used) == len(set(used))
  # no unused resident expert left: the miss is dropped, with weight 0
  d3 = P.decide(logits_of(probs), state_with([1, 3]), P.DecideParams("substitute_all"), cfg)
  assert list(np.asarray(d3.action[0])) == [P.SUBSTITUTE, P.HIT, P.DROP]
  assert float(d3.weights[0, 2]) == 0.0 and int(d3.exec_ids[0, 2]) == -1


def test_drop_variant_renormalises_remaining_weights():
  cfg = cfg_for(top_k=3, norm=False)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  d = P.decide(logits_of(probs), state_with([1, 3]),
               P.DecideParams("substitute_all", substitution="drop"), cfg)
  assert list(np.asarray(d.action[0])) == [P.DROP, P.HIT, P.DROP]
  w = np.asarray(d.weights[0])
  assert w[0] == 0 and w[2] == 0
  np.testing.assert_allclose(w[1], 0.75, rtol=1e-5)         # all selected mass on the hit
  assert list(np.asarray(d.exec_ids[0])) == [-1, 1, -1]


def test_admission_fires_exactly_at_beta_and_resets():
  cfg = cfg_for()
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  st = state_with([0, 5])                      # e1 misses and is substituted
  # the accumulated quantity is the share g / sum(selected g) (= g up to rounding here)
  g1 = float(P.decide(logits_of(probs), st, P.DecideParams("substitute_all"), cfg).share[0, 1])
  # beta just above g: no admission, the accumulator keeps g
  pol = P.DecideParams("substitute_all", admission_beta=float(np.nextafter(np.float32(g1),
                                                                            np.float32(2))))
  d = P.decide(logits_of(probs), st, pol, cfg)
  assert not bool(d.admit.any())
  assert float(d.acc[1]) == pytest.approx(g1, rel=1e-6) and float(d.acc.sum()) == float(d.acc[1])
  st2 = P.update_usage(st, d, P.CacheParams())
  d2 = P.decide(logits_of(probs), st2, pol, cfg)         # 2 g >= beta: fires and resets
  assert list(np.flatnonzero(np.asarray(d2.admit))) == [1]
  assert float(d2.acc[1]) == 0.0
  # beta exactly g: fires on the first substitution
  d3 = P.decide(logits_of(probs), st, dataclasses.replace(pol, admission_beta=g1), cfg)
  assert list(np.flatnonzero(np.asarray(d3.admit))) == [1] and float(d3.acc[1]) == 0.0
  # a fetched miss adds nothing
  d4 = P.decide(logits_of(probs), st, P.DecideParams("fetch_all", admission_beta=0.01), cfg)
  assert float(d4.acc.sum()) == 0.0 and not bool(d4.admit.any())


def test_usage_update_lru_and_decayed_lfu_counts_every_selection():
  cfg = cfg_for(top_k=3)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  st = state_with([1, 3, 4, 7])
  pol = P.PolicyParams(P.DecideParams("substitute_all"), P.CacheParams(lfu_decay=0.5))
  st = dataclasses.replace(st, freq=jnp.full((8,), 2.0), step=jnp.int32(7))
  d = P.decide(logits_of(probs), st, pol, cfg)              # selects 0,1,2; executes 3,1,4
  st2 = P.update_usage(st, d, pol)
  np.testing.assert_allclose(np.asarray(st2.freq), [2, 2, 2, 1, 1, 1, 1, 1])
  assert list(np.asarray(st2.last_used)) == [-1, 7, -1, 7, 7, -1, -1, -1]
  assert int(st2.step) == 8


def test_eviction_order_lru_and_lfu():
  st = state_with([0, 1, 2, 3], slots=4)
  st = dataclasses.replace(st, last_used=jnp.asarray([5, 2, 9, 4, 0, 0, 0, 0], jnp.int32),
                           freq=jnp.asarray([1.0, 3.0, 0.5, 0.5, 0, 0, 0, 0], jnp.float32))
  none = jnp.zeros((4,), bool)
  lru, lfu = P.CacheParams(eviction="lru"), P.CacheParams(eviction="lfu")
  assert int(EV.victim_slot(st, none, lru)) == 1            # oldest use: e1 (t=2)
  assert int(EV.victim_slot(st, none, lfu)) == 3            # freq tie 0.5 (e2, e3): lru -> e3
  prot = jnp.asarray([False, True, False, True])
  assert int(EV.victim_slot(st, prot, lru)) == 0            # protected slots are never chosen
  assert int(EV.victim_slot(st, prot, lfu)) == 2
  assert int(EV.victim_slot(st, jnp.ones((4,), bool), lru)) == -1
  part = state_with([0, 1], slots=4)                        # empty slots come first
  assert int(EV.victim_slot(part, none, lru)) == 2
  assert int(EV.victim_slot(part, none, lfu)) == 2


def test_eviction_order_is_the_lexicographic_order_of_its_keys():
  # (protected, freq [lfu], last use, slot), ascending, empty slots first: checked against
  # numpy's lexsort on random states with many ties
  rng = np.random.default_rng(0)
  for trial in range(40):
    slots, num_e = 6, 12
    res = rng.choice(num_e, size=rng.integers(0, slots + 1), replace=False)
    st = state_with([int(e) for e in res], num_experts=num_e, slots=slots)
    st = dataclasses.replace(st, last_used=jnp.asarray(rng.integers(-1, 3, num_e), jnp.int32),
                             freq=jnp.asarray(rng.integers(0, 3, num_e) * 0.5, jnp.float32))
    prot = rng.random(slots) < 0.3
    for ev in ("lru", "lfu"):
      order, usable = EV.eviction_order(st, jnp.asarray(prot), P.CacheParams(eviction=ev))
      se = np.asarray(st.slot_expert)
      empty = se < 0
      last = np.where(empty, -2, np.asarray(st.last_used)[np.maximum(se, 0)])
      freq = (np.where(empty, -np.inf, np.asarray(st.freq)[np.maximum(se, 0)]) if ev == "lfu"
              else np.zeros(slots))
      ref = np.lexsort((np.arange(slots), last, freq, prot.astype(int)))
      np.testing.assert_array_equal(np.asarray(order), ref, err_msg=f"{ev} trial {trial}")
      assert int(usable) == int((~prot).sum())


def test_presets_and_bad_policies():
  q, s, b = (P.make_policy(n) for n in ("quality", "speed", "baseline"))
  assert (q.miss, q.tau, q.eviction, q.admission_beta) == ("threshold", 0.15, "lfu", 0.5)
  assert (s.miss, s.eviction, s.admission_beta) == ("first_choice", "lfu", 0.5)
  assert (b.miss, b.eviction, b.admission_beta) == ("fetch_all", "lru", None)
  assert P.make_policy("quality", tau=0.3).tau == 0.3
  with pytest.raises(P.PolicyError, match="--policy"):
    P.make_policy("fastest")
  for tau in (0.0, -0.1, 1.5):
    with pytest.raises(P.PolicyError, match="--tau"):
      P.make_policy("threshold", tau=tau)
  P.make_policy("threshold", tau=1.0)
  for beta in (0.0, -1.0):
    with pytest.raises(P.PolicyError, match="--admission_beta"):
      P.make_policy("quality", admission_beta=beta)
  with pytest.raises(P.PolicyError, match="--eviction"):
    P.make_policy("baseline", eviction="fifo")


def family_cfg(model_type, router, num_experts=4, top_k=1, **kw):
  return ModelConfig(model_type=model_type, vocab_size=16, hidden_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=num_experts,
                     top_k=top_k, moe_intermediate_size=4, intermediate_size=8,
                     sparse_layers=(True,), router=router, **kw).validate()


@pytest.mark.parametrize("model_type,router", [("gpt_oss", "topk_softmax"),
                                               ("qwen3_moe", "softmax")])
def test_substitutes_ranked_by_router_logits_not_underflowing_probabilities(model_type, router):
  # softmax([200, -2, -1, -3]) underflows to [1, 0, 0, 0] in f32: by probability e1 and e2
  # tie (and e1 would win); by logit e2 (-1) beats e1 (-2)
  cfg = family_cfg(model_type, router)
  logits = jnp.asarray([[200.0, -2.0, -1.0, -3.0]])
  d = P.decide(logits, state_with([1, 2], num_experts=4, slots=2),
               P.DecideParams("substitute_all"), cfg)
  assert list(np.asarray(d.action[0])) == [P.SUBSTITUTE]
  assert int(d.sub_ids[0, 0]) == 2


def test_substitute_ties_go_to_the_lowest_id():
  cfg = family_cfg("qwen3_moe", "softmax", num_experts=6)
  logits = jnp.asarray([[5.0, 1.0, 0.0, 1.0, 1.0, 0.0]])       # e1, e3, e4 tie
  for resident, want in (([4, 3, 1], 1), ([4, 3], 3), ([5, 2], 2)):
    d = P.decide(logits, state_with(resident, num_experts=6, slots=3),
                 P.DecideParams("substitute_all"), cfg)
    assert int(d.sub_ids[0, 0]) == want, resident


def test_sigmoid_group_substitutes_ranked_by_biased_score():
  cfg = family_cfg("glm4_moe", "sigmoid_group", num_experts=4, top_k=1,
                   family_config=GlmConfig(n_group=1, topk_group=1, routed_scaling_factor=2.5))
  raw = [3.0, 0.0, 0.0, 0.0]
  bias = [0.0, 0.1, 0.3, 0.0]            # e2 has the larger sigmoid(logit) + bias
  d = P.decide(jnp.asarray([raw + bias]), state_with([1, 2], num_experts=4, slots=2),
               P.DecideParams("substitute_all"), cfg)
  assert int(d.sub_ids[0, 0]) == 2
  d2 = P.decide(jnp.asarray([raw + [0.0, 0.3, 0.1, 0.0]]),
                state_with([1, 2], num_experts=4, slots=2), P.DecideParams("substitute_all"), cfg)
  assert int(d2.sub_ids[0, 0]) == 1


def test_admission_accumulates_the_normalised_share_not_the_raw_gate():
  # unnormalised softmax top-2: gates (.30, .25), e1's share .25 / .55 = 5/11 ~ .4545
  cfg = cfg_for(norm=False)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  st = state_with([0, 5])
  d = P.decide(logits_of(probs), st, P.DecideParams("substitute_all", admission_beta=0.6), cfg)
  assert float(d.gates[0, 1]) == pytest.approx(0.25, rel=1e-5)
  assert float(d.acc[1]) == pytest.approx(5 / 11, rel=1e-5)
  d = P.decide(logits_of(probs), st, P.DecideParams("substitute_all", admission_beta=0.45), cfg)
  assert list(np.flatnonzero(np.asarray(d.admit))) == [1]      # share .4545 >= .45 > g


def test_admission_with_scaled_sigmoid_router_uses_share():
  # routed_scaling 2.5 with normalised top-2: gates sum to 2.5; share = g / 2.5
  cfg = family_cfg("glm4_moe", "sigmoid_group", num_experts=4, top_k=2,
                   family_config=GlmConfig(n_group=1, topk_group=1, routed_scaling_factor=2.5))
  raw = [2.0, 0.0, -3.0, -3.0]           # sigmoid .881, .5: shares .638, .362
  d = P.decide(jnp.asarray([raw]), state_with([0, 2], num_experts=4, slots=2),
               P.DecideParams("substitute_all", admission_beta=0.5), cfg)
  s1 = 0.5 / (0.5 + 1 / (1 + np.exp(-2.0)))
  assert float(d.gates[0, 1]) == pytest.approx(2.5 * s1, rel=1e-5)   # raw g ~ .905 >= .5
  assert float(d.acc[1]) == pytest.approx(s1, rel=1e-5)              # share ~ .362 < .5
  assert not bool(d.admit.any())


@pytest.mark.parametrize("params,action", [
    (P.DecideParams("host", admission_beta=10.0), P.HOST),
    (P.DecideParams("substitute_all", substitution="drop", admission_beta=10.0), P.DROP),
    (P.DecideParams("substitute_all", admission_beta=10.0), P.DROP),   # no substitute left
])
def test_admission_counts_dropped_and_host_misses(params, action):
  cfg = cfg_for(top_k=2, norm=False)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  d = P.decide(logits_of(probs), state_with([0]), params, cfg)   # e0 hit, e1 missed
  assert list(np.asarray(d.action[0])) == [P.HIT, action]
  np.testing.assert_allclose(np.asarray(d.acc), [0, 5 / 11, 0, 0, 0, 0, 0, 0], rtol=1e-5)


def test_policy_params_split_into_decide_and_cache_keys():
  q, s = P.make_policy("quality"), P.make_policy("speed")
  assert q.cache == s.cache == P.CacheParams("lfu", 0.98)
  assert q.decision != s.decision
  a = P.make_policy("threshold", eviction="lru")
  b = P.make_policy("threshold", eviction="lfu", lfu_decay=0.5)
  assert a.decision == b.decision and hash(a.decision) == hash(b.decision)
  assert a.cache != b.cache
  assert (q.miss, q.tau, q.admission_beta, q.eviction, q.lfu_decay) == (
      "threshold", 0.15, 0.5, "lfu", 0.98)
  # every function takes its part or the whole policy, with the same result
  cfg = cfg_for(top_k=3)
  probs = [0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]
  st = state_with([1, 3, 4, 7])
  d_part, d_all = (P.decide(logits_of(probs), st, p, cfg) for p in (q.decision, q))
  chex.assert_trees_all_equal(d_part, d_all)         # the whole Decision, every field
  u_part, u_all = (P.update_usage(st, d_part, p) for p in (q.cache, q))
  chex.assert_trees_all_equal(u_part, u_all)
