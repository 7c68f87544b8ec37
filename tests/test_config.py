"""ModelConfig from config.json: both spellings, and errors that name the field."""

import json

import pytest

from moejax.model.config import ConfigError, ModelConfig

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
