"""Qwen3-MoE's config (model_type ``qwen3_moe``): the `ConfigSpec` defaults, and export."""

from __future__ import annotations

from moejax.model.families.configs.base import ConfigSpec


class Qwen3MoeSpec(ConfigSpec):
  model_types = ("qwen3_moe",)

  def to_hf_dict(self, cfg):
    """The hub config.json of `cfg` (the demo model's training exports it with it)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size or 4 * cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, s in enumerate(cfg.sparse_layers) if not s],
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "torch_dtype": "bfloat16", "use_sliding_window": False,
    }


SPEC = Qwen3MoeSpec()
