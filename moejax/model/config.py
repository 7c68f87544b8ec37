"""ModelConfig: a frozen description of an MoE transformer, read from a HF config.json.

Both the hub spelling of fields (``num_experts``, ``rope_theta``) and the
transformers-v5 spelling (``num_local_experts``, ``rope_parameters``) are read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from moejax.model import families
from moejax.model.families.base import ConfigError, field_getter  # pylint: disable=unused-import

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only MoE model (one field per HF config concept)."""

  model_type: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_experts: int
  top_k: int
  moe_intermediate_size: int        # routed expert hidden size
  intermediate_size: int            # dense MLP hidden size (layers that are not sparse)
  sparse_layers: tuple[bool, ...]   # per layer: routed MoE (True) or dense MLP (False)
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: str = "none"             # "none" | "head" (qwen3) | "full" (olmoe)
  clip_qkv: float | None = None
  router: str = "softmax"           # family routing rule, see moejax.model.routing
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  # qwen3_next (see moejax.model.families.qwen3_next)
  layer_types: tuple[str, ...] = ()  # HF layer_types per layer; () = all full attention
  partial_rotary_factor: float = 1.0  # RoPE on the first factor * head_dim dims
  linear_conv_kernel_dim: int = 4   # Gated DeltaNet layers ("linear_attention")
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  shared_expert_intermediate_size: int = 0  # sigmoid-gated shared expert (0 = none)
  # gpt_oss (see moejax.model.families.gpt_oss); layer_types "sliding_attention" use the window
  sliding_window: int | None = None  # sliding layers see keys with position > q - window
  rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs, e.g. YaRN
  swiglu_alpha: float = 1.702       # clamped SwiGLU experts: gate * sigmoid(alpha * gate)
  swiglu_limit: float = 7.0         # gate <= limit, -limit <= up <= limit
  # glm4_moe / glm4_moe_lite / deepseek_v3 (see moejax.model.families.glm)
  n_group: int = 1                  # expert groups for group-limited top-k
  topk_group: int = 1               # groups kept per token
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0         # ungated shared experts (size n * moe_intermediate_size)
  num_mtp_layers: int = 0           # hub tensors of these extra (MTP) layers are ignored
  q_lora_rank: int | None = None    # MLA; kv_lora_rank == 0 means not MLA
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i, s in enumerate(self.sparse_layers) if s)

  @property
  def expert_param_count(self) -> int:
    return sum(math.prod(s) for s in families.of(self).expert_shapes(self).values())

  def validate(self) -> "ModelConfig":
    def need(cond: bool, field: str, msg: str):
      if not cond:
        raise ConfigError(f"config field '{field}': {msg}")
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "num_experts", "top_k",
              "moe_intermediate_size"):
      need(getattr(self, f) > 0, f, f"must be positive, got {getattr(self, f)}")
    need(self.top_k <= self.num_experts, "num_experts_per_tok",
         f"top-k {self.top_k} is larger than the expert count {self.num_experts}")
    need(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
         f"{self.num_kv_heads} kv heads do not divide {self.num_heads} query heads")
    need(len(self.sparse_layers) == self.num_layers, "mlp_only_layers",
         "per-layer sparsity does not cover every layer")
    need(self.qk_norm in ("none", "head", "full"), "qk_norm", self.qk_norm)
    families.get(self.model_type).validate(self, need)
    return self

  # ------------------------------------------------------------------ io
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    family = families.get(d.get("model_type"), source)
    fields = family.config_fields(d, field_getter(d, source), source)
    return cls(model_type=d["model_type"], **fields).validate()

  @classmethod
  def from_json_file(cls, path: str) -> "ModelConfig":
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.exists(path):
      raise ConfigError(f"{path}: no such file (a model folder needs a config.json)")
    try:
      with open(path) as f:
        d = json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return cls.from_hf_dict(d, source=path)

  def to_hf_dict(self) -> dict[str, Any]:
    """The hub spelling of this config (used when exporting a model)."""
    return families.of(self).to_hf_dict(self)
