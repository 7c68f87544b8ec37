"""The benchmark models' routers route like a trained model's (benchmarks/routing.py).

A small model of the wide models' construction is written, loaded through the one loader,
and its router logits are recorded teacher-forced on held-out text exactly as
`launch.trace --text=held_out --seq=512` does; the statistics are read on those.
"""

import dataclasses
import os

import numpy as np
import pytest

from benchmarks import models, routing, stream
from moejax.io import traces
from moejax.io.loader import load_model
from moejax.model.config import ModelConfig

TOK = os.path.join(models.DEMO_DIR, "tokenizer.json")
pytestmark = pytest.mark.skipif(not os.path.exists(TOK), reason="needs ckpts/demo's tokenizer")


def small_config(layers: int = 2) -> ModelConfig:
  """The wide models' kind at a width a test can run: 128 experts, top-8, as they have."""
  return dataclasses.replace(models.wide_config(layers), hidden_size=256, num_heads=4,
                             num_kv_heads=2, head_dim=64, moe_intermediate_size=32,
                             intermediate_size=512).validate()


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
  cfg = small_config()
  d = models.save_wide(str(tmp_path_factory.mktemp("routed")), shards=2, cfg=cfg,
                       progress=False)
  cfg, params, store = load_model(d)
  ids = stream.held_out_ids(TOK, 2048)
  logits, _ = traces.record_router_logits(cfg, params, store, ids, seq=512, batch=4)
  return cfg, ids, logits


def test_an_lru_of_a_quarter_hits_like_a_trained_model_and_the_load_is_balanced(routed):
  cfg, _, logits = routed
  st = routing.stats(routing.top_k_ids(logits, cfg.top_k), cfg.num_experts)
  assert 0.77 <= st["lru_hit_mean"] <= 0.83, st
  assert max(st["lru_hit_per_layer"]) <= 0.90, st
  # locality, not popularity: the same tokens shuffled hit little more than chance (0.25)
  assert st["lru_hit_shuffled_mean"] < 0.40, st
  assert st["busiest8_share_max"] <= 2 * 8 / cfg.num_experts, st


def test_the_numpy_replica_predicts_the_models_selections(routed):
  """`routing.logits` is what the design is calibrated on: the model must agree with it
  (up to bf16 rounding and the random layers' small writes to the norm)."""
  cfg, ids, logits = routed
  d = models.routed_design(cfg)
  want = routing.top_k_ids(routing.logits(d, ids, seq=512), cfg.top_k)
  got = routing.top_k_ids(logits, cfg.top_k)
  same = np.mean([len(set(a) & set(b)) / cfg.top_k
                  for a, b in zip(want.reshape(-1, cfg.top_k), got.reshape(-1, cfg.top_k))])
  assert same > 0.95, same


def test_stats_on_a_hand_made_stream():
  # one layer, 4 experts, top-1, an LRU of 1: a a b b -> hits at t=1 and t=3
  ids = np.array([0, 0, 1, 1])[:, None, None]
  st = routing.stats(ids, 4, fraction=0.25)
  assert st["lru_slots"] == 1 and st["lru_hit_per_layer"] == [0.5]
  assert st["busiest8_share_per_layer"] == [1.0]


def test_a_model_too_small_for_the_construction_is_refused():
  cfg = small_config()
  with pytest.raises(ValueError, match="too small"):
    routing.layout(dataclasses.replace(cfg, num_kv_heads=1, num_heads=4))
