"""Router traces: round trip, recording, and errors that name the file (issue 14)."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io import traces
from moejax.model.config import ModelConfig
from moejax.io.loader import init_random
from moejax.model.model import Transformer
from moejax.io.store import ExpertStore

HF = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
      "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
      "norm_topk_prob": True, "mlp_only_layers": [1]}


def write(path, t=10, **kw):
  lg = np.random.default_rng(0).standard_normal((t, 2, 8)).astype(np.float32)
  traces.write_trace(str(path), HF, lg, np.arange(t), **kw)
  return lg


def test_round_trip_in_shards(tmp_path):
  lg = write(tmp_path, t=10, dtype="float32", shard_tokens=4, documents=[0, 6])
  assert sorted(os.listdir(tmp_path)) == ["logits-00000.safetensors", "logits-00001.safetensors",
                                          "logits-00002.safetensors", "trace.json"]
  tr = traces.load_trace(str(tmp_path))
  np.testing.assert_array_equal(tr.logits_TxLxR, lg)
  np.testing.assert_array_equal(tr.token_ids, np.arange(10))
  assert tr.cfg.moe_layers == (0, 2) and tr.meta["documents"] == [0, 6]
  assert traces.load_trace(str(tmp_path), max_tokens=5).num_tokens == 5


def test_float16_storage(tmp_path):
  lg = write(tmp_path, dtype="float16")
  tr = traces.load_trace(str(tmp_path))
  chex.assert_type(tr.logits_TxLxR, np.float16)
  np.testing.assert_allclose(tr.logits_TxLxR.astype(np.float32), lg, atol=2e-3)


def test_truncated_shard_names_the_file(tmp_path):
  write(tmp_path, shard_tokens=4)
  shard = tmp_path / "logits-00001.safetensors"
  shard.write_bytes(shard.read_bytes()[:-10])
  with pytest.raises(traces.TraceError, match="logits-00001.safetensors.*truncated"):
    traces.load_trace(str(tmp_path))


def test_trace_from_another_model_is_refused(tmp_path):
  write(tmp_path)
  other = ModelConfig.from_hf_dict(dict(HF, num_experts=16))
  with pytest.raises(traces.TraceError, match="trace.json: trace recorded from another model"):
    traces.load_trace(str(tmp_path), expect=other)
  traces.load_trace(str(tmp_path), expect=ModelConfig.from_hf_dict(HF))     # the same: fine


def test_missing_and_inconsistent_files(tmp_path):
  with pytest.raises(traces.TraceError, match="trace.json: no such file"):
    traces.load_trace(str(tmp_path))
  write(tmp_path, shard_tokens=4)
  os.remove(tmp_path / "logits-00002.safetensors")
  with pytest.raises(traces.TraceError, match="logits-00002.safetensors: no such file"):
    traces.load_trace(str(tmp_path))


def test_recording_equals_the_model_forward_per_window():
  cfg = ModelConfig.from_hf_dict(HF)
  params, exps = init_random(cfg, seed=1)
  store = ExpertStore.from_stacked(exps)
  toks = np.random.default_rng(2).integers(0, 32, 11)
  lg, windows = traces.record_router_logits(cfg, params, store, toks, seq=4, batch=2)
  assert windows == [(0, 4), (4, 4), (8, 3)]
  chex.assert_shape(lg, (11, 2, 8))
  # the second window on its own (its context starts at token 4); MoE layers 0 and 2
  model = Transformer(cfg)
  _, _, rl = jax.jit(lambda p, e, t: model.apply({"params": p}, t, e))(
      params, store.to_device(), jnp.asarray(toks[4:8][None]))
  np.testing.assert_allclose(lg[4:8, 0], np.asarray(rl[0][0]), atol=1e-5)
  np.testing.assert_allclose(lg[4:8, 1], np.asarray(rl[2][0]), atol=1e-5)
