"""moejax.model.routing: ties between -0.0 and +0.0 router logits go to the lowest expert id.

XLA's top_k orders floats by their bits, so it ranks +0.0 above -0.0; the documented
rule is that equal scores go to the lowest expert id, and -0.0 == +0.0.  Every rule
`route` dispatches to (softmax, gpt_oss's topk_softmax, glm's sigmoid_group) and
`rank_scores` (which the offload policy's substitute top_k ranks by) must follow it,
jitted or not.  NaN and inf are passed through as before.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import cpu_kernel
from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.model.families.configs.glm import GlmConfig

N0, P0 = -0.0, 0.0

# (logits row, top_k, ids): -0.0 at a lower id than +0.0, tied for the k-th place
CASES = [
    ([1.0, N0, P0, -1.0], 2, [0, 1]),
    ([-1.0, N0, -2.0, P0], 1, [1]),
    ([-1.0, N0, -2.0, P0], 2, [1, 3]),
    ([N0, 2.0, P0, -3.0], 2, [1, 0]),
    ([-5.0, N0, N0, P0], 2, [1, 2]),
]

RULES = [("qwen3_moe", "softmax"), ("gpt_oss", "topk_softmax"), ("glm4_moe", "sigmoid_group")]


def _cfg(model_type, router, num_experts=4, top_k=2, **kw):
  return ModelConfig(model_type=model_type, vocab_size=16, hidden_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=num_experts,
                     top_k=top_k, moe_intermediate_size=4, intermediate_size=8,
                     sparse_layers=(True,), router=router, **kw).validate()


def _variants(fn):
  return {"eager": fn, "jit": jax.jit(fn, static_argnums=0)}


def _route_ids(cfg, logits, jitted):
  return np.asarray(_variants(routing.route)[jitted](cfg, jnp.asarray(logits))[0])


def _rank_top_k(cfg, logits, jitted):
  f = lambda c, x: jax.lax.top_k(routing.rank_scores(c, x), c.top_k)[1]
  return np.asarray(_variants(f)[jitted](cfg, jnp.asarray(logits)))


def test_xla_top_k_ranks_positive_zero_first():
  # the premise: without canonical zeros, top_k breaks the tie by sign, not by id
  ids = jax.lax.top_k(jnp.asarray([N0, P0]), 1)[1]
  assert int(ids[0]) == 1


@pytest.mark.parametrize("jitted", ["eager", "jit"])
@pytest.mark.parametrize("model_type,router", RULES)
def test_signed_zero_tie_goes_to_lowest_id(model_type, router, jitted):
  for row, k, want in CASES:
    cfg = _cfg(model_type, router, top_k=k)
    logits = [row] if router != "sigmoid_group" else [row + [0.0] * 4]    # zero bias
    chex.assert_trees_all_equal(_route_ids(cfg, logits, jitted), np.asarray([want], np.int32))
    got = _rank_top_k(cfg, logits, jitted)
    np.testing.assert_array_equal(got, [want], err_msg=f"rank_scores {row} k={k}")


@pytest.mark.parametrize("jitted", ["eager", "jit"])
def test_signed_zero_tie_in_the_bias_and_in_groups_of_sigmoid_group(jitted):
  # sigmoid(+-0) = 0.5: groups {0,1} and {4,5} score 1.0 (top-2 sum), the others ~0;
  # the bias half carries -0.0 at the lower ids and +0.0 at the higher ones
  cfg = _cfg("glm4_moe", "sigmoid_group", num_experts=8, top_k=3,
             family_config=GlmConfig(n_group=4, topk_group=2))
  raw = [N0, N0, -30.0, -30.0, P0, P0, -30.0, -30.0]
  bias = [N0, N0, P0, P0, P0, P0, P0, P0]
  ids = _route_ids(cfg, [raw + bias], jitted)
  chex.assert_trees_all_equal(ids, np.asarray([[0, 1, 4]], np.int32))
  np.testing.assert_array_equal(_rank_top_k(cfg, [raw + bias], jitted), [[0, 1, 4]])
  # the bias alone decides: -0.0 (id 0) and +0.0 (id 1) over equal logits
  cfg = _cfg("glm4_moe", "sigmoid_group", num_experts=4, top_k=1)
  logits = [[0.0, 0.0, -1.0, -1.0] + [N0, P0, P0, P0]]
  chex.assert_trees_all_equal(_route_ids(cfg, logits, jitted), np.asarray([[0]], np.int32))


@pytest.mark.parametrize("jitted", ["eager", "jit"])
@pytest.mark.parametrize("model_type,router", RULES)
def test_rank_scores_have_no_negative_zero(model_type, router, jitted):
  cfg = _cfg(model_type, router)
  row = [N0, P0, N0, 1.0]
  logits = jnp.asarray([row if router != "sigmoid_group" else row + [-0.5, -0.5, -0.5, N0]])
  s = np.asarray(_variants(routing.rank_scores)[jitted](cfg, logits))
  assert not np.any(np.signbit(s) & (s == 0)), s


@pytest.mark.parametrize("jitted", ["eager", "jit"])
@pytest.mark.parametrize("model_type,router", RULES)
def test_nan_and_inf_pass_through_as_before(model_type, router, jitted):
  # routing with canonical zeros == the family's rule on the raw logits when no zero is
  # present: NaN, +inf and -inf rows give the same ids, gates and scores as before
  rule, rank = routing.RULES[router]
  rows = [[np.nan, 1.0, 2.0, -1.0], [np.inf, 1.0, -np.inf, 2.0], [-np.inf, -np.inf, 1.0, 3.0],
          [np.nan, np.nan, np.nan, np.nan], [np.inf, np.inf, -1.0, -2.0]]
  if router == "sigmoid_group":
    rows = [r + b for r, b in zip(rows, ([0.1, np.nan, 0.1, 0.1], [np.inf, 0.1, 0.1, -np.inf],
                                         [0.1] * 4, [0.1] * 4, [-np.inf, 0.1, 0.1, 0.1]))]
  logits = jnp.asarray(rows, jnp.float32)
  cfg = _cfg(model_type, router)
  got = _variants(routing.route)[jitted](cfg, logits)
  want = _variants(rule)[jitted](cfg, logits)
  chex.assert_trees_all_equal(tuple(got), tuple(want))
  got_s = _variants(routing.rank_scores)[jitted](cfg, logits)
  np.testing.assert_array_equal(np.asarray(got_s), np.asarray(rank(cfg, logits)))
  s = np.asarray(got_s)
  assert np.isnan(s).any() and np.isinf(s).any()


@pytest.mark.parametrize("model_type,router", RULES)
def test_gradients_through_zero_logits_are_unchanged(model_type, router):
  # train.py differentiates through route's scores: canonical zeros have the identity's
  # derivative, so a logit of exactly +-0.0 gets the gradient the rule gives +0.0 (not 0)
  cfg = _cfg(model_type, router)
  rule, _ = routing.RULES[router]
  row = [N0, P0, 1.0, -0.5] + ([N0, 0.1, P0, 0.0] if router == "sigmoid_group" else [])
  x = jnp.asarray([row])
  x_canonical = jnp.asarray([[abs(v) if v == 0 else v for v in row]])
  loss = lambda f: lambda lg: jnp.sum(f(cfg, lg)[1] ** 2) + jnp.sum(jnp.sin(f(cfg, lg)[2]))
  g = jax.grad(loss(routing.route))(x)
  chex.assert_trees_all_close(g, jax.grad(loss(rule))(x_canonical), rtol=1e-6, atol=1e-7)
  assert np.all(np.asarray(g)[0, :2] != 0), g


def test_softmax_rule_without_the_cpu_kernel():
  # the XLA path of the softmax rule (other platforms, or MOEJAX_CPU_KERNEL=0); fresh
  # functions, traced inside the context (compiled ones keep their choice)
  with cpu_kernel.enabled(False):
    for row, k, want in CASES:
      cfg = _cfg("qwen3_moe", "softmax", top_k=k)
      x = jnp.asarray([row])
      for f in (lambda x: routing.route(cfg, x)[0], jax.jit(lambda x: routing.route(cfg, x)[0])):
        np.testing.assert_array_equal(np.asarray(f(x)), [want])
