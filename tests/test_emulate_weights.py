"""moejax-emulate --weights (issue 61 part 5): the emulator runs a weight format's blocks, so
fetch_all's perplexity is the format's; a full fetch counts the blocks' bytes; the runs' file
names keep formats apart; a GGUF given --weights is a usage error."""

import jax.numpy as jnp
import numpy as np
import pytest
from absl import app, flags
from absl.testing import flagsaver

from moejax.cli import emulate as EM
from moejax.io.loader import init_random, save_hf
from moejax.model.config import ModelConfig
from moejax.research.study import metrics as M
from moejax.research.study import runner as R
from moejax.research.study import streams as S

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8, top_k=2,
                  moe_intermediate_size=32, intermediate_size=64, sparse_layers=(True, True),
                  qk_norm="head", rope_theta=10000.0, max_position_embeddings=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  d = tmp_path_factory.mktemp("emw")
  params, exps = init_random(CFG, seed=1, scale=0.2)
  save_hf(CFG, params, exps, str(d / "hf"))
  return str(d / "hf")


@pytest.fixture(autouse=True)
def parsed(monkeypatch, tmp_path):
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path / "cache"))
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["emulate"])


def _ppl(folder, weights, out):
  with flagsaver.flagsaver(weights=weights, dtype="float32"):
    cfg, params, store = EM.load(folder)
    shapes = {k: np.shape(v) for k, v in store.get(0, 0).items()}
    nbytes, tag = EM.full_nbytes(store, shapes), EM.weights_tag()
  rng = np.random.default_rng(0)
  docs = [("stdlib", str(i), list(rng.integers(1, 64, 40)) + [0]) for i in range(8)]
  st = S.build(docs, num_streams=4, max_tokens=128, window=32, seed=0, round_to=8)
  run = R.Runner(cfg, params, store, st, out, max_len=32, chunk=8).run(
      "fetch_all" + tag, *R.parse_spec("fetch_all"), cache_fraction=0.25)
  return M.metrics(run, None, 10)["ppl"], nbytes, tag, store


def test_a_weight_format_is_what_the_emulator_runs(folder, tmp_path):
  f32, f_bytes, f_tag, _ = _ppl(folder, "float", str(tmp_path / "o"))
  q8, q8_bytes, q8_tag, store = _ppl(folder, "q8_0", str(tmp_path / "o"))
  q4, _, q4_tag, _ = _ppl(folder, "q4_0", str(tmp_path / "o"))
  assert sorted(store.stacked(0)) == ["down@q8_0", "gate_up@q8_0"]
  assert (f_tag, q8_tag, q4_tag) == ("", "_wq8_0", "_wq4_0")       # runs kept apart
  assert f_bytes == 2 * 3 * 32 * 64                                 # bf16 rows
  assert q8_bytes == store.expert_nbytes() == 3 * 32 * 2 * 34      # the blocks
  assert q8 != f32 and abs(q8 / f32 - 1) < 0.01                     # the format's own
  assert abs(q4 / f32 - 1) > abs(q8 / f32 - 1)                      # 4 bits lose more


def test_a_gguf_with_weights_is_a_usage_error(tmp_path):
  with flagsaver.flagsaver(weights="q8_0"):
    with pytest.raises(app.UsageError, match="--weights=q8_0 applies to a safetensors"):
      EM.load(str(tmp_path / "model.gguf"))
