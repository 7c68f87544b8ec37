"""Default vectors and next-layer predictors on a tiny random qwen3_moe model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.prefetch import speculation
from moejax.model.config import ModelConfig
from moejax.io.loader import init_random
from moejax.model.model import Transformer

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                  moe_intermediate_size=8, intermediate_size=64, sparse_layers=(True,) * 3,
                  norm_topk_prob=True, qk_norm="head").validate()


def _model(seed=0):
  params, experts = init_random(CFG, seed=seed, scale=0.3)
  return params, [{k: jnp.asarray(v) for k, v in e.items()} for e in experts]


def _swiglu(x_D, e):
  gu = e["gate_up"] @ x_D
  g, u = np.split(gu, 2)
  return e["down"] @ (g / (1 + np.exp(-g)) * u)


def test_default_vectors_are_unweighted_mean_expert_outputs():
  params, experts = _model()
  toks = np.random.default_rng(1).integers(0, 64, (3, 16)).astype(np.int32)
  vecs, counts = speculation.default_vectors(CFG, params, experts, toks, batch=2)
  recs = Transformer(CFG).apply({"params": params}, jnp.asarray(toks), experts,
                                method=speculation._forward_layers)
  for l, r in enumerate(recs):
    assert counts[l].sum() == toks.size * CFG.top_k
    sums = np.zeros((CFG.num_experts, CFG.hidden_size))
    ew = {k: np.asarray(v) for k, v in experts[l].items()}
    for x, ids in zip(np.asarray(r["moe_in"]), np.asarray(r["ids"])):
      for e in ids:
        sums[e] += _swiglu(x, {k: v[e] for k, v in ew.items()})
    want = sums / np.maximum(counts[l], 1)[:, None]
    np.testing.assert_allclose(vecs[l], want, atol=1e-5)
    assert np.all(vecs[l][counts[l] == 0] == 0)


def test_predictions_are_exact_when_nothing_happens_between_routers():
  """Layer 0's experts output zero and layer 1's attention adds nothing: then layer 1's
  router sees Norm_1(r_0) exactly, so reuse = quasi (D = 0) = the true logits."""
  params, experts = _model()
  experts[0] = jax.tree_util.tree_map(jnp.zeros_like, experts[0])
  p = jax.tree_util.tree_map(lambda x: x, params)
  o = p["layers_1"]["self_attn"]["o_proj"]
  p["layers_1"]["self_attn"]["o_proj"] = jax.tree_util.tree_map(jnp.zeros_like, o)
  toks = np.random.default_rng(2).integers(0, 64, (2, 12)).astype(np.int32)
  vecs, _ = speculation.default_vectors(CFG, p, experts, toks)
  assert np.all(vecs[0] == 0)
  pairs = speculation.predictions(CFG, p, experts, [jnp.asarray(v) for v in vecs],
                                  jnp.asarray(toks))
  assert len(pairs) == 2
  np.testing.assert_allclose(pairs[0]["reuse"], pairs[0]["true"], atol=1e-5)
  np.testing.assert_allclose(pairs[0]["quasi"], pairs[0]["true"], atol=1e-5)
  # with layer 1's attention back, the prediction is no longer exact
  pairs = speculation.predictions(CFG, params, experts, [jnp.asarray(v) for v in vecs],
                                  jnp.asarray(toks))
  assert np.abs(np.asarray(pairs[0]["reuse"]) - np.asarray(pairs[0]["true"])).max() > 1e-3


def test_topk_agreement_hand_checked():
  cfg = ModelConfig(**{**CFG.__dict__, "num_experts": 4, "top_k": 2})
  true = jnp.log(jnp.array([[0.6, 0.3, 0.05, 0.05], [0.1, 0.1, 0.5, 0.3]]))
  pred = jnp.array([[5.0, 0.0, 4.0, 0.0], [0.0, 0.0, 2.0, 1.0]])
  a = speculation.topk_agreement(cfg, true, pred)
  # token 0: true {0, 1}, predicted {0, 2}: recall 1/2, mass 0.6/0.9; token 1: exact
  assert a["recall_at_k"] == pytest.approx(0.75)
  assert a["exact_match"] == pytest.approx(0.5)
  assert a["mass_covered"] == pytest.approx((0.6 / 0.9 + 1.0) / 2, rel=1e-5)


def test_default_vectors_command_says_what_it_does_before_the_long_steps(tmp_path):
  # the bug: moejax-default-vectors printed nothing for 69 s (loading, encoding the corpus,
  # compiling the pass) and then one line at the end
  import os, subprocess, sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(1, 8192, 512).astype(np.int32))
  proc = subprocess.run([sys.executable, "-m", "launch.default_vectors",
                         f"--model_dir={os.path.join(repo, 'ckpts', 'demo')}", "--windows=2",
                         "--seq=16", "--batch=2", f"--tokens_file={tmp_path / 't.npy'}",
                         f"--out={tmp_path / 'out'}"], cwd=repo, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  said = [l for l in proc.stderr.splitlines() if l.startswith("[moejax] ")]
  assert [l.split()[1] for l in said] == ["loading", "reading", "averaging"], proc.stderr
  assert "2 windows of 16 tokens, 1 batch of 2" in said[2]
  assert "\r" not in proc.stderr               # bars only on a terminal
  assert f"wrote {tmp_path / 'out'}" in proc.stdout
