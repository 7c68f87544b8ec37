"""Estimators: zero-initialised correction, learning a drift, resume, shards on disk."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.estimators import data as est_data
from moejax.prefetch.estimator import LogitCorrection, estimate, previous_input, takes_previous
from moejax.estimators.train import EstimatorConfig, kl_loss, loss_fn, topk_ce, train_pair
from moejax.model.config import ModelConfig

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=8, num_experts=8, top_k=2,
                  moe_intermediate_size=8, intermediate_size=32, sparse_layers=(True, True),
                  norm_topk_prob=True).validate()


def _pairs(n, seed):
  """quasi logits miss a drift that is a fixed function of q: the estimator's job."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((n, 16)).astype(np.float32)
  quasi = rng.standard_normal((n, 8)).astype(np.float32)
  drift = np.random.default_rng(99).standard_normal((16, 8)).astype(np.float32)
  return {"q": q, "quasi": quasi, "true": quasi + 1.5 * np.tanh(q @ drift)}


def test_untrained_estimator_is_the_quasi_predictor():
  m = LogitCorrection(8, 4)
  q, base = jnp.ones((3, 16)), jnp.arange(24.0).reshape(3, 8)
  p = m.init(__import__("jax").random.PRNGKey(0), q, base)
  chex.assert_trees_all_close(m.apply(p, q, base), base)
  with pytest.raises(AssertionError):
    m.apply(p, q, base[:, :4])


def test_training_recovers_the_drift_and_resumes(tmp_path):
  train, held = _pairs(4096, 0), _pairs(1024, 1)
  ec = EstimatorConfig(hidden=32, lr=1e-2, batch=256, epochs=6, patience=6)
  _, hist = train_pair(CFG, train, held, ec, str(tmp_path / "a"))
  assert hist[-1]["recall_at_k"] > hist[0]["recall_at_k"] + 0.15, hist
  assert hist[-1]["kl"] < 0.5 * hist[0]["kl"]
  # killed after 3 epochs, restarted: the same history and parameters
  train_pair(CFG, train, held, ec, str(tmp_path / "b"), stop_at=3)
  pb, hb = train_pair(CFG, train, held, ec, str(tmp_path / "b"))
  pa, _ = train_pair(CFG, train, held, ec, str(tmp_path / "a"))   # finished: restores
  chex.assert_trees_all_close(pa, pb, atol=1e-6)
  assert hb[-1]["recall_at_k"] == pytest.approx(hist[-1]["recall_at_k"], abs=1e-6)


def test_topk_ce_hand_checked():
  # true top-2 of [3, 2, 1, 0] is {0, 1}; predicted probabilities 0.4 and 0.1 there
  pred = jnp.log(jnp.asarray([[0.4, 0.1, 0.25, 0.25]]))
  true = jnp.asarray([[3.0, 2.0, 1.0, 0.0]])
  want = -(np.log(0.4) + np.log(0.1)) / 2                     # 1.6094
  assert float(topk_ce(pred, true, 2)) == pytest.approx(want, rel=1e-5)
  assert float(loss_fn(pred, true, 2, 0.0)) == pytest.approx(float(kl_loss(pred, true)))
  assert float(loss_fn(pred, true, 2, 0.5)) == pytest.approx(
      float(kl_loss(pred, true)) + 0.5 * want, rel=1e-5)


def test_topk_weight_still_learns_the_drift(tmp_path):
  """With the top-k term the estimator still learns the drift (recall rises over quasi)."""
  train, held = _pairs(4096, 0), _pairs(1024, 1)
  ec = EstimatorConfig(hidden=32, lr=1e-2, batch=256, epochs=4, patience=4, topk_weight=1.0)
  _, hist = train_pair(CFG, train, held, ec, str(tmp_path / "tk"))
  assert hist[-1]["recall_at_k"] > hist[0]["recall_at_k"] + 0.15, hist


def test_train_stream_refuses_domains_with_a_tokens_file(tmp_path):
  np.save(tmp_path / "train_tokens.npy", np.arange(10, dtype=np.int32))
  got = est_data.train_stream("unused", str(tmp_path / "train_tokens.npy"))
  np.testing.assert_array_equal(got, np.arange(10))
  with pytest.raises(ValueError, match="--tokens_file holds every corpus domain"):
    est_data.train_stream("unused", str(tmp_path / "train_tokens.npy"), ("python",))


def test_shards_load_and_name_a_bad_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="no estimator training shards"):
    est_data.load(str(tmp_path))
  a = {k: np.ones((2, 3, 4), np.float16) for k in ("q", "quasi", "true")}
  np.savez(tmp_path / "shard_00000.npz", **a)
  np.savez(tmp_path / "shard_00001.npz", **a)
  got = est_data.load(str(tmp_path))
  chex.assert_shape([got["q"], est_data.load(str(tmp_path), pair=1)["true"]], [(2, 6, 4), (6, 4)])
  (tmp_path / "shard_00002.npz").write_bytes(b"truncated")
  with pytest.raises(ValueError, match="shard_00002.npz"):
    est_data.load(str(tmp_path))


def test_previous_probs_hand_checked():
  """Row t gets softmax(true[t - 1]); a window's first row gets zeros."""
  true = np.log(np.asarray([[1, 1], [1, 3], [2, 2], [3, 1], [1, 1]], np.float32))
  got = est_data.previous_probs(true, seq=3)
  want = np.asarray([[0, 0], [0.5, 0.5], [0.25, 0.75],      # window 1: rows 0-2
                     [0, 0], [0.75, 0.25]], np.float32)      # window 2: rows 3-4
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_estimate_with_the_previous_tokens_routing_hand_checked():
  """An estimator with D + E input rows takes [q, softmax(previous logits)] (zeros where
  no previous token); one with D rows takes q alone and ignores them."""
  import jax
  np.testing.assert_allclose(previous_input(jnp.log(jnp.asarray([[1.0, 3.0], [1.0, 1.0]])),
                                            jnp.asarray([True, False])),
                             [[0.25, 0.75], [0.0, 0.0]], atol=1e-6)
  e, d = 2, 3
  m = LogitCorrection(e, 2)
  p = m.init(jax.random.PRNGKey(0), jnp.zeros((1, d + e)), jnp.zeros((1, e)))
  # hidden = [p_prev[0], p_prev[1]] (q ignored), out = 4 * silu(hidden)
  kernel_in = np.zeros((d + e, 2), np.float32)
  kernel_in[d:, :] = np.eye(e)
  p = {"params": {"w_in": {"kernel": jnp.asarray(kernel_in), "bias": jnp.zeros(2)},
                  "w_out": {"kernel": 4.0 * jnp.eye(e), "bias": jnp.zeros(e)}}}
  assert takes_previous(p, d) and not takes_previous(p, d + e)
  q, base = jnp.ones((2, d)), jnp.asarray([[0.0, 0.5], [0.0, 0.5]])
  last, has = jnp.log(jnp.asarray([[3.0, 1.0], [3.0, 1.0]])), jnp.asarray([True, False])
  silu = lambda v: v / (1 + np.exp(-v))
  want = np.asarray([[4 * silu(0.75), 0.5 + 4 * silu(0.25)], [0.0, 0.5]])
  np.testing.assert_allclose(estimate(p, q, base, last, has), want, atol=1e-5)
  with pytest.raises(ValueError, match="previous token"):
    estimate(p, q, base)
  p_q = m.init(jax.random.PRNGKey(0), jnp.zeros((1, d)), jnp.zeros((1, e)))
  chex.assert_trees_all_close(estimate(p_q, q, base, last, has), m.apply(p_q, q, base))


def test_estimator_inputs_compare_finds_the_informative_input(tmp_path):
  """benchmarks.estimator_inputs: when the next router's logits repeat the previous token's,
  the variant given the previous token's probabilities must beat q alone."""
  from benchmarks import estimator_inputs as ei
  rng = np.random.default_rng(0)
  n, seq = 4096, 8
  q = rng.standard_normal((n, 16)).astype(np.float32)
  quasi = rng.standard_normal((n, 8)).astype(np.float32)
  sticky = np.repeat(rng.standard_normal((n // seq, 8)) * 4, seq, 0).astype(np.float32)
  true = quasi + sticky          # one routing bias per window: predictable from the row before
  split = lambda s: {"q": q[s], "quasi": quasi[s], "true": true[s]}
  train, held = split(slice(0, 3072)), split(slice(3072, n))
  ec = EstimatorConfig(hidden=32, lr=1e-2, batch=128, epochs=6, patience=6)
  res = ei.compare(CFG, train, held, None, None, ec, seq, str(tmp_path))
  assert set(res) == {"quasi", "q", "q+prev"}           # no layer before the first pair
  assert res["q+prev"]["recall_at_k"] > res["q"]["recall_at_k"] + 0.1, res
