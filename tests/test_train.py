"""Training: hand-checked auxiliary losses, learning, and exact resume from orbax."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.train_demo import run_training, stage_overrides
from moejax.model.config import ModelConfig
from benchmarks.trainer import TrainConfig, aux_losses, balance_schedule, revive_experts

TINY = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                   moe_intermediate_size=8, intermediate_size=64, sparse_layers=(True, True),
                   qk_norm="head").validate()


def test_balance_loss_hand_checked():
  cfg = ModelConfig(**{**TINY.__dict__, "num_experts": 2, "top_k": 1})
  l9 = float(np.log(9.0))  # softmax([l9, 0]) = [0.9, 0.1]
  balanced = jnp.array([[l9, 0.0], [0.0, l9]])       # f = [.5,.5], P = [.5,.5] -> 2*.5 = 1
  skewed = jnp.array([[l9, 0.0], [l9, 0.0]])         # f = [1, 0], P = [.9,.1] -> 2*.9 = 1.8
  bal, z, loc, lbal = aux_losses(cfg, [balanced, None], locality="tv")
  np.testing.assert_allclose(float(bal), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(z), float(jnp.mean(jax.nn.logsumexp(balanced, -1) ** 2)))
  np.testing.assert_allclose(float(loc), 0.8, rtol=1e-6)   # TV([.9,.1], [.1,.9]) = 0.8
  bal_s, _, loc_s, lbal_s = aux_losses(cfg, [skewed], locality="tv")
  np.testing.assert_allclose(float(bal_s), 1.8, rtol=1e-6)
  np.testing.assert_allclose(float(loc_s), 0.0, atol=1e-7)  # same routing twice
  # centred logits [l9/2, -l9/2] twice vs mirrored: batch means (l9/2)^2 vs 0
  np.testing.assert_allclose(float(lbal), 0.0, atol=1e-7)
  np.testing.assert_allclose(float(lbal_s), (l9 / 2) ** 2, rtol=1e-6)


def test_cosine_locality_hand_checked():
  cfg = ModelConfig(**{**TINY.__dict__, "num_experts": 3, "top_k": 1})
  a, b = [1.0, 0.0, -1.0], [-1.0, 0.0, 1.0]           # centred already; cos = -1
  bal, z, loc, lbal = aux_losses(cfg, [jnp.array([a, b])])
  chex.assert_shape((bal, z, loc, lbal), ((), (), (), ()))
  assert float(loc) == pytest.approx(2.0, rel=1e-5)
  # scale-free: a sharper copy of the same preference costs nothing
  assert float(aux_losses(cfg, [jnp.array([a, [5.0, 2.0, -1.0]])])[2]) == pytest.approx(0.0, abs=1e-6)


def test_balance_scope_sequence_vs_batch_hand_checked():
  """Two sequences, each using one expert only: balanced over the batch, not per sequence."""
  cfg = ModelConfig(**{**TINY.__dict__, "num_experts": 2, "top_k": 1})
  l9 = float(np.log(9.0))
  seq0 = [[l9, 0.0], [l9, 0.0]]                       # f = [1, 0], P = [.9, .1]
  seq1 = [[0.0, l9], [0.0, l9]]                       # f = [0, 1], P = [.1, .9]
  logits = jnp.array([seq0, seq1])
  np.testing.assert_allclose(float(aux_losses(cfg, [logits], "batch")[0]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(aux_losses(cfg, [logits], "sequence")[0]), 1.8, rtol=1e-6)


def test_balance_schedule_switches_at_step():
  tc = TrainConfig(balance_coef_start=0.01, balance_coef=0.03, balance_switch_step=200)
  assert float(balance_schedule(tc, 199)) == pytest.approx(0.01)
  assert float(balance_schedule(tc, 200)) == pytest.approx(0.03)


@pytest.fixture(scope="module")
def stream():
  # a learnable stream: a repeated pseudo-random pattern of 97 tokens
  pat = np.random.default_rng(0).integers(0, 64, 97)
  return np.tile(pat, 40).astype(np.uint16)


def test_training_learns_and_resumes_exactly(stream, tmp_path):
  # expert revival every 4 steps (threshold high enough that it fires) is part of the run
  tc = TrainConfig(steps=16, warmup=2, lr=1e-2, batch=4, seq=32, seed=0, revive_every=4,
                   revive_threshold=0.9, revive_until=1.0)
  log_a = tmp_path / "a.jsonl"
  (pa, ea), step = run_training(TINY, tc, stream, str(tmp_path / "a"), save_every=8,
                                log_path=str(log_a))
  assert step == 16
  import json
  ce = [json.loads(l)["ce"] for l in open(log_a)]
  assert ce[-1] < ce[0] - 0.5, ce   # it learns the repeated pattern
  revived = [sum(json.loads(l).get("revived", [0])) for l in open(log_a)]
  assert sum(revived) > 0, revived

  # killed after step 8 (checkpointed), restarted: same data order, same result
  _, s8 = run_training(TINY, tc, stream, str(tmp_path / "b"), save_every=8, stop_at=8)
  assert s8 == 8
  (pb, eb), step_b = run_training(TINY, tc, stream, str(tmp_path / "b"), save_every=8)
  assert step_b == 16
  chex.assert_trees_all_close((pa, ea), (pb, eb), atol=0, rtol=0)


def test_second_stage_starts_from_the_first_stages_weights(stream, tmp_path):
  tc = TrainConfig(steps=6, warmup=1, lr=1e-2, batch=4, seq=32, seed=0)
  first, _ = run_training(TINY, tc, stream, str(tmp_path / "a"), save_every=6)
  # a stage stopped before its first step holds exactly the first stage's weights ...
  tc2 = dataclasses.replace(tc, seed=1, lr=1e-3)
  same, step = run_training(TINY, tc2, stream, str(tmp_path / "b"), save_every=6, stop_at=0,
                            init_from=str(tmp_path / "a"))
  assert step == 0
  chex.assert_trees_all_close(same, first, atol=0, rtol=0)
  # ... and one that runs moves them (a fresh optimizer, a new schedule)
  moved, step = run_training(TINY, tc2, stream, str(tmp_path / "c"), save_every=6,
                             init_from=str(tmp_path / "a"))
  assert step == 6
  diff = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), moved, first)
  assert min(jax.tree_util.tree_leaves(diff)) > 0, diff   # every array trained on
  with pytest.raises(Exception, match="no checkpoint"):
    run_training(TINY, tc2, stream, str(tmp_path / "d"), save_every=6,
                 init_from=str(tmp_path / "nothing"))


def test_a_stage_starts_from_an_exported_model(stream, tmp_path):
  """--init_from=<model dir> (config.json + model.safetensors, e.g. a shipped model):
  the same weights as the run that exported it; another layout is refused."""
  from moejax.io.loader import save_hf
  tc = TrainConfig(steps=4, warmup=1, lr=1e-2, batch=4, seq=32, seed=0)
  (params, experts), _ = run_training(TINY, tc, stream, str(tmp_path / "a"), save_every=4)
  save_hf(TINY, params, experts, str(tmp_path / "export"))
  same, step = run_training(TINY, dataclasses.replace(tc, seed=1), stream, str(tmp_path / "b"),
                            save_every=4, stop_at=0, init_from=str(tmp_path / "export"))
  assert step == 0
  chex.assert_trees_all_close(same, (params, experts), atol=0, rtol=0)
  other = ModelConfig(**{**TINY.__dict__, "num_experts": 2, "top_k": 1})
  with pytest.raises(Exception, match="not this run's layout"):
    run_training(other, tc, stream, str(tmp_path / "c"), save_every=4,
                 init_from=str(tmp_path / "export"))


def test_init_from_git_history(tmp_path):
  """git:<commit>:<folder> extracts a model folder from the repository's history; a commit
  it lacks is a UsageError naming the flag (not a traceback)."""
  import subprocess
  from absl import app
  from benchmarks.train_demo import _init_dir
  with pytest.raises(app.UsageError, match="--init_from=git:0000000:ckpts/demo"):
    _init_dir("git:0000000:ckpts/demo", str(tmp_path / "a"))
  if subprocess.run(["git", "cat-file", "-e", "cc5f790"], capture_output=True).returncode:
    pytest.skip("shallow clone: the first demo model's commit is not in the history")
  d = _init_dir("git:cc5f790:ckpts/demo", str(tmp_path / "b"))
  assert ModelConfig.from_json_file(d).num_experts == 64


def test_stage2_overrides_are_typed_and_checked():
  assert stage_overrides("steps=1000, lr=1e-3,locality_loss=mi,seed=1") == dict(
      steps=1000, lr=1e-3, locality_loss="mi", seed=1)
  assert stage_overrides("") == {}
  with pytest.raises(Exception, match="--stage2: 'stepz=3' is not field=value"):
    stage_overrides("stepz=3")
  with pytest.raises(Exception, match="--stage2: steps='ten' is not a int"):
    stage_overrides("steps=ten")


def test_revive_experts_splits_the_most_loaded_expert_into_the_dead_one():
  # one MoE layer (layer 1; layer 0 dense), E = 4: expert 2 is dead, expert 0 the most loaded
  D, E = 3, 4
  w_ExD = jnp.arange(E * D, dtype=jnp.float32).reshape(E, D) + 1.0
  params = {"layers_1": {"mlp": {"gate": {"weight": w_ExD}}}, "other": jnp.ones(2)}
  ex = {"gate_up": jnp.arange(E * 2 * 5, dtype=jnp.float32).reshape(E, 2, 5),
        "down": -jnp.arange(E * 5 * 1, dtype=jnp.float32).reshape(E, 5, 1)}
  load_LxE = np.array([[0.5, 0.3, 0.01, 0.19]])  # 0.01 < 0.25 / 4
  (p2, (_, ex2)), revived = revive_experts((params, [None, ex]), load_LxE, threshold=0.25,
                                      noise=0.1, seed=0)
  assert revived == [1]
  w2 = p2["layers_1"]["mlp"]["gate"]["weight"]
  # the dead row and the donor row are the donor's row -/+ the same perturbation
  np.testing.assert_allclose((w2[0] + w2[2]) / 2, w_ExD[0], rtol=1e-6)
  assert float(jnp.abs(w2[2] - w2[0]).max()) > 0
  np.testing.assert_array_equal(np.asarray(w2)[[1, 3]], np.asarray(w_ExD)[[1, 3]])      # other experts untouched
  for k in ex:
    np.testing.assert_array_equal(ex2[k][2], ex[k][0])          # dead expert = donor's weights
    np.testing.assert_array_equal(np.asarray(ex2[k])[[0, 1, 3]], np.asarray(ex[k])[[0, 1, 3]])
  assert params["layers_1"]["mlp"]["gate"]["weight"] is w_ExD   # input not mutated
  # nothing dead: nothing changes
  (_, ex3), revived = revive_experts((params, [None, ex]), np.full((1, E), 0.25), 0.25, 0.1, 0)
  assert revived == [0] and ex3[1] is ex


def test_mutual_information_locality_hand_checked():
  """Two sequences, softmax [.9, .1] and [.1, .9] on both tokens: each sequence's entropy
  h(.9) = 0.3251 nats, the batch mean [.5, .5] has ln 2; loss = h(.9) - ln 2.  The same
  preference in both sequences (a constant router) gains nothing: loss 0."""
  cfg = ModelConfig(**{**TINY.__dict__, "num_experts": 2, "top_k": 1})
  l9 = float(np.log(9.0))
  a, b = [[l9, 0.0], [l9, 0.0]], [[0.0, l9], [0.0, l9]]
  h9 = -(0.9 * np.log(0.9) + 0.1 * np.log(0.1))
  loc = aux_losses(cfg, [jnp.array([a, b])], locality="mi")[2]
  np.testing.assert_allclose(float(loc), h9 - np.log(2.0), rtol=1e-5)
  loc_same = aux_losses(cfg, [jnp.array([a, a])], locality="mi")[2]
  np.testing.assert_allclose(float(loc_same), 0.0, atol=1e-6)
