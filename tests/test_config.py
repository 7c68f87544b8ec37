"""ModelConfig from config.json: both spellings, and errors that name the field."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from moejax.model.config import ConfigError, ModelConfig
from moejax.model.families import configs
from moejax.model.families.configs.glm import GlmConfig
from moejax.model.families.configs.gpt_oss import GptOssConfig
from moejax.model.families.configs.qwen3_next import Qwen3NextConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN_HUB = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
                norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3],
                rope_theta=1e6, tie_word_embeddings=False, eos_token_id=[5, 6])


def test_hub_and_v5_spellings_agree():
  hub = ModelConfig.from_hf_dict(QWEN_HUB)
  v5 = dict(QWEN_HUB)
  v5.pop("num_experts"), v5.pop("rope_theta")
  v5.update(num_local_experts=8, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
  assert ModelConfig.from_hf_dict(v5) == hub
  assert hub.num_experts == 8 and hub.rope_theta == 1e6
  # decoder_sparse_step=2 -> layers 1, 3 sparse; 3 is in mlp_only_layers -> only layer 1
  assert hub.sparse_layers == (False, True, False, False)
  assert hub.eos_token_ids == (5, 6)


def test_mixtral_and_olmoe_rules():
  mix = ModelConfig.from_hf_dict(dict(QWEN_HUB, model_type="mixtral", num_local_experts=8,
                                      intermediate_size=24))
  assert mix.moe_intermediate_size == 24 and mix.qk_norm == "none"
  assert all(mix.sparse_layers)
  d = {k: v for k, v in QWEN_HUB.items() if k != "norm_topk_prob"}
  olm = ModelConfig.from_hf_dict(dict(d, model_type="olmoe", intermediate_size=24))
  assert olm.qk_norm == "full" and not olm.norm_topk_prob  # OLMoE's default


@pytest.mark.parametrize("change, field", [
    (dict(model_type="llama"), "model_type"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(head_dim=None, hidden_size=66), "num_attention_heads"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_bad_config_names_the_field(change, field):
  d = dict(QWEN_HUB)
  d.update(change)
  d = {k: v for k, v in d.items() if v is not None}
  with pytest.raises(ConfigError, match=field):
    ModelConfig.from_hf_dict(d)


def test_from_file_errors(tmp_path):
  with pytest.raises(ConfigError, match="no such file"):
    ModelConfig.from_json_file(str(tmp_path))
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ConfigError, match="not valid JSON"):
    ModelConfig.from_json_file(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(QWEN_HUB))
  assert ModelConfig.from_json_file(str(tmp_path)).num_layers == 4


def test_importing_the_config_loads_no_jax_flax_or_kernels():
  code = ("import sys, moejax.model.config; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax') "
          "or m.startswith('moejax.kernels') or m.startswith('moejax.model.layers')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "[]", out.stdout


def test_family_fields_live_in_the_family_sub_config():
  shared = {f.name for f in dataclasses.fields(ModelConfig)}
  assert not shared & set(configs.family_field_defaults())
  # left out, family_config is the family's default sub-config
  base = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
              head_dim=4, num_experts=4, top_k=1, moe_intermediate_size=4,
              intermediate_size=8, sparse_layers=(True,))
  assert ModelConfig(model_type="glm4_moe", **base).family_config == GlmConfig()
  assert type(ModelConfig(model_type="qwen3_moe", **base).family_config) is configs.FamilyConfig
  with pytest.raises(ConfigError, match="family_config.*GptOssConfig, got Qwen3NextConfig"):
    ModelConfig(model_type="gpt_oss", family_config=Qwen3NextConfig(), **base).validate()
  oss = ModelConfig.from_hf_dict(dict(QWEN_HUB, model_type="gpt_oss", num_local_experts=8,
                                      sliding_window=8, swiglu_limit=5.0))
  assert oss.family_config == GptOssConfig(sliding_window=8, swiglu_limit=5.0)
  assert oss.flat_dict()["swiglu_limit"] == 5.0 and oss.flat_dict()["n_group"] == 1


def test_config_hash_still_matches_the_committed_demo_estimators():
  """The hash hashes the pre-sub-config layout: files written before still load."""
  from moejax.io.traces import config_hash  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, "ckpts", "demo-estimators", "estimators.json")) as f:
    want = json.load(f)["config_hash"]
  assert config_hash(ModelConfig.from_json_file(os.path.join(REPO, "ckpts", "demo"))) == want
