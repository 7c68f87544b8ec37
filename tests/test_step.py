"""The per-layer step (`cache.step`): typed pytrees, and the vmapped tails equal the
tails one layer at a time (the engine and the emulator run them at once after the last
layer; the simulator runs `policy_step`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import policy as P
from moejax.cache import resident as R
from moejax.cache import step as S
from moejax.model.config import ModelConfig


def tiny_cfg():
  return ModelConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=8, top_k=2,
                     moe_intermediate_size=4, intermediate_size=8, sparse_layers=(True,),
                     qk_norm="head", norm_topk_prob=True).validate()


def _layers(cfg, rule, n=3, seed=0):
  """n layers' states (a few experts resident) and router outputs."""
  rng = np.random.default_rng(seed)
  states, routers = [], []
  for l in range(n):
    st = R.init_state(cfg.num_experts, 3, {}, buffers=False)
    st, _ = R.insert(st, jnp.asarray([l, l + 1], jnp.int32), None,
                     jnp.zeros((cfg.num_experts,), bool), rule.cache)
    states.append(st)
    routers.append(S.route(cfg, jnp.asarray(rng.standard_normal((1, cfg.num_experts)),
                                            jnp.float32)))
  return states, routers


def test_vmapped_tails_equal_each_layers_step():
  cfg = tiny_cfg()
  pol = P.make_policy("quality", admission_beta=0.2)
  rule = S.Rule(cfg, pol.decision, pol.cache, trim_to=2)
  states, routers = _layers(cfg, rule)
  none = S.Prediction.none(cfg)
  want = [S.policy_step(rule, st, r, none) for st, r in zip(states, routers)]
  heads = [S.policy_head(rule, st, r, none, None) for st, r in zip(states, routers)]
  stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
  got_states, got_steps = S.policy_tails(rule, stack([h[0] for h in heads]),
                                         stack([h[1] for h in heads]))
  chex.assert_trees_all_equal(got_states, stack([w[0] for w in want]))
  chex.assert_trees_all_equal(got_steps, stack([w[1] for w in want]))
  # the record's counts are `counts` of its fields, stacked or one layer at a time
  rec = S.record(got_steps, stack([S.Pending.none(cfg.top_k)] * 3))
  per_layer = [S.layer_counts(w[1], S.Pending.none(cfg.top_k)) for w in want]
  np.testing.assert_array_equal(S.record_counts(jnp, rec), jnp.stack(per_layer))
  np.testing.assert_array_equal(S.record_counts(np, jax.device_get(rec)), jnp.stack(per_layer))


def test_pending_is_five_distinct_arrays_and_steps_are_pytrees():
  p = S.Pending.none(4)
  leaves = jax.tree_util.tree_leaves(p)
  assert len(leaves) == 5 and len({id(a) for a in leaves}) == 5
  assert all(np.asarray(a).tolist() == [-1] * 4 for a in leaves)
  cfg = tiny_cfg()
  pol = P.make_policy("baseline")
  rule = S.Rule(cfg, pol.decision, pol.cache)
  (st,), (r,) = _layers(cfg, rule, n=1)
  _, step = jax.jit(lambda s, r: S.policy_step(rule, s, r, S.Prediction.none(cfg)))(st, r)
  assert isinstance(step.pending, S.Pending) and isinstance(step.head, S.Head)
  assert step.evicted.shape == (cfg.top_k + 3,)
