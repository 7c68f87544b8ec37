"""The family registry: lookup, the interface's defaults, and no family tests outside it."""

import os
import re

import numpy as np
import pytest

from moejax.model import families
from moejax.model.config import ConfigError, ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_model_type_has_exactly_one_family():
  assert set(families.MODEL_TYPES) == {"qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe",
                                       "glm4_moe_lite", "deepseek_v3", "gpt_oss"}
  for t in families.MODEL_TYPES:
    assert t in families.get(t).model_types


def test_unknown_model_type_names_the_supported_ones():
  with pytest.raises(ConfigError, match=r"x/config.json: unknown or unsupported model_type "
                                        r"'llama'; supported: qwen3_moe, mixtral"):
    families.get("llama", "x/config.json")
  with pytest.raises(ConfigError, match="unsupported model_type None"):
    ModelConfig.from_hf_dict({})


def test_mixtral_tensor_names_map_to_the_qwen3_moe_spelling():
  f = families.get("mixtral")
  assert (f.rename_tensor("model.layers.3.block_sparse_moe.experts.7.w1.weight")
          == "model.layers.3.mlp.experts.7.gate_proj.weight")
  assert (f.rename_tensor("model.layers.0.block_sparse_moe.experts.12.w2.weight")
          == "model.layers.0.mlp.experts.12.down_proj.weight")
  assert (f.rename_tensor("model.layers.0.block_sparse_moe.gate.weight")
          == "model.layers.0.mlp.gate.weight")
  assert families.get("qwen3_moe").rename_tensor("model.layers.0.mlp.w1.weight") == (
      "model.layers.0.mlp.w1.weight")


def test_expert_dicts_are_recognised_by_their_layout():
  plain = {"gate_up": np.zeros((2, 4, 3)), "down": np.zeros((2, 3, 2))}
  oss = dict(plain, gate_up_bias=np.zeros((2, 4)), down_bias=np.zeros((2, 3)))
  assert families.for_experts(plain).expert_ffn is None
  assert families.for_experts(oss) is families.get("gpt_oss")


def _cfg(model_type, **kw):
  return ModelConfig(model_type=model_type, vocab_size=16, hidden_size=4, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=2, num_experts=4, top_k=1,
                     moe_intermediate_size=2, intermediate_size=8, sparse_layers=(True, True),
                     **kw)


def test_expert_param_count_follows_the_family_layout():
  # D = 4, I = 2: gate_up 2I x D + down D x I = 24; gpt_oss adds biases 2I + D = 8
  assert _cfg("qwen3_moe").expert_param_count == 24
  assert _cfg("gpt_oss", layer_types=("full_attention",) * 2).expert_param_count == 32


def test_export_is_qwen3_moe_only():
  assert _cfg("qwen3_moe").to_hf_dict()["model_type"] == "qwen3_moe"
  with pytest.raises(ConfigError, match="export is only implemented for qwen3_moe, not olmoe"):
    _cfg("olmoe").to_hf_dict()


def test_no_code_outside_families_tests_for_a_family():
  pattern = re.compile(r"model_type\s*(==|!=|in\b)|from moejax\.model\.families(\.configs)? "
                       r"import (glm|gpt_oss|qwen3_next|mixtral|olmoe|qwen3_moe)")
  hits = []
  for top in ("moejax", "launch"):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      if "families" in os.path.relpath(root, REPO).split(os.sep):
        continue  # families/ and families/configs/
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(root, name)
          with open(path) as f:
            hits += [f"{path}:{i}" for i, line in enumerate(f, 1) if pattern.search(line)]
  assert not hits, hits
