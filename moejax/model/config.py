"""ModelConfig: a frozen description of an MoE transformer, read from a HF config.json.

Both the hub spelling of fields (``num_experts``, ``rope_theta``) and the
transformers-v5 spelling (``num_local_experts``, ``rope_parameters``) are read.
Importing this module loads neither jax nor flax nor ``moejax.kernels``: the config
rules of the families live in ``moejax.model.families.configs`` (plain Python).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from moejax.model.families import configs
from moejax.model.families.configs.base import ConfigError, FamilyConfig, field_getter


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only MoE model (one field per HF config concept).

  The fields here are the ones every family has, plus three general concepts more
  than one family reads:
    ``layer_types``            the token mixer of each layer (HF spelling): qwen3_next's
                               "linear_attention" / "full_attention", gpt_oss's
                               "sliding_attention" / "full_attention";
    ``partial_rotary_factor``  RoPE on the first factor * head_dim dims (qwen3_next, glm4_moe);
    ``rope_scaling``           RoPE scaling parameters, e.g. YaRN (gpt_oss, deepseek_v3,
                               glm4_moe_lite).
  What only one family reads is in ``family_config``, that family's frozen sub-config
  (``configs.qwen3_next.Qwen3NextConfig``, ``configs.gpt_oss.GptOssConfig``,
  ``configs.glm.GlmConfig``; a plain `FamilyConfig` for qwen3_moe, mixtral and olmoe).
  Left out (None), it is the family's default sub-config.
  """

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
  layer_types: tuple[str, ...] = ()  # HF layer_types per layer; () = all full attention
  partial_rotary_factor: float = 1.0  # RoPE on the first factor * head_dim dims
  rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs, e.g. YaRN
  family_config: FamilyConfig | None = None  # the family's own fields; None: its defaults

  def __post_init__(self):
    if self.family_config is None:
      spec = configs.REGISTRY.get(self.model_type)
      object.__setattr__(self, "family_config",
                         spec.config_cls() if spec is not None else FamilyConfig())

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i, s in enumerate(self.sparse_layers) if s)

  @property
  def expert_param_count(self) -> int:
    return sum(math.prod(s) for s in configs.get(self.model_type).expert_shapes(self).values())

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
    spec = configs.get(self.model_type)
    need(type(self.family_config) is spec.config_cls, "family_config",
         f"{self.model_type} takes a {spec.config_cls.__name__}, got "
         f"{type(self.family_config).__name__}")
    spec.validate(self, need)
    return self

  # ------------------------------------------------------------------ io
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    spec = configs.get(d.get("model_type"), source)
    fields = spec.config_fields(d, field_getter(d, source), source)
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
    return configs.get(self.model_type).to_hf_dict(self)

  def flat_dict(self) -> dict[str, Any]:
    """Every field one level deep, as before the family sub-configs: the shared fields,
    this family's fields, and every other family's fields at their defaults (the layout
    ``moejax.io.traces.config_hash`` hashes, so hashes written before still match)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fam = d.pop("family_config")
    d.update(configs.family_field_defaults())
    d.update({f.name: getattr(fam, f.name) for f in dataclasses.fields(fam)})
    return d
