"""ModelConfig: a frozen description of an MoE transformer, read from a HF config.json.

Both the hub spelling of fields (``num_experts``, ``rope_theta``) and the
transformers-v5 spelling (``num_local_experts``, ``rope_parameters``) are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe", "glm4_moe_lite", "deepseek_v3", "gpt_oss")


class ConfigError(ValueError):
  """A config.json that moejax cannot use; the message names the field."""


def field_getter(d: dict[str, Any], source: str):
  """get(*names, default=...): the first of `names` set in config dict `d` (hub or v5
  spelling); without a default, a missing field is a ConfigError naming it."""
  def get(*names, default=dataclasses.MISSING):
    for n in names:
      if d.get(n) is not None:
        return d[n]
    if default is dataclasses.MISSING:
      raise ConfigError(f"{source}: missing field '{names[0]}'")
    return default
  return get


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
  router: str = "softmax"           # family routing rule, see moejax.routing
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  # qwen3_next (see moejax.families.qwen3_next)
  layer_types: tuple[str, ...] = ()  # HF layer_types per layer; () = all full attention
  partial_rotary_factor: float = 1.0  # RoPE on the first factor * head_dim dims
  zero_centred_norm: bool = False   # RMSNorm weights applied as (1 + w)
  attn_output_gate: bool = False    # q_proj gives [q | gate]; attention out * sigmoid(gate)
  linear_conv_kernel_dim: int = 4   # Gated DeltaNet layers ("linear_attention")
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  shared_expert_intermediate_size: int = 0  # sigmoid-gated shared expert (0 = none)
  # gpt_oss (see moejax.families.gpt_oss); layer_types "sliding_attention" use the window
  sliding_window: int | None = None  # sliding layers see keys with position > q - window
  rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs, e.g. YaRN
  swiglu_alpha: float = 1.702       # clamped SwiGLU experts: gate * sigmoid(alpha * gate)
  swiglu_limit: float = 7.0         # gate <= limit, -limit <= up <= limit
  # glm4_moe / glm4_moe_lite / deepseek_v3 (see moejax.families.glm)
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
    n = 3 * self.hidden_size * self.moe_intermediate_size
    if self.model_type == "gpt_oss":  # + gate_up and down biases
      n += 2 * self.moe_intermediate_size + self.hidden_size
    return n

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
    if self.router == "sigmoid_group":
      from moejax.families import glm  # pylint: disable=g-import-not-at-top
      glm.validate(self, need)
    if self.model_type == "qwen3_next":
      from moejax.families import qwen3_next
      qwen3_next.validate(self, need)
    return self

  # ------------------------------------------------------------------ io
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(
          f"{source}: unknown or unsupported model_type {mt!r}; "
          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if mt in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):
      from moejax.families import glm  # pylint: disable=g-import-not-at-top
      return glm.config_from_hf(cls, d, source)

    get = field_getter(d, source)

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    if d.get("head_dim") is None and hidden % heads:
      raise ConfigError(
          f"{source}: field 'num_attention_heads' ({heads}) does not divide "
          f"'hidden_size' ({hidden}) and no 'head_dim' is given")
    head_dim = int(get("head_dim", default=hidden // heads))
    layers = int(get("num_hidden_layers"))
    experts = int(get("num_experts", "num_local_experts"))
    rope = d.get("rope_parameters") or {}
    rope_scaling = d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope_scaling.get("rope_type", rope_scaling.get("type", "default")))
    if rope_type not in ("default", None) and mt != "gpt_oss":  # gpt_oss: YaRN
      raise ConfigError(f"{source}: field 'rope_scaling': rope type {rope_type!r} is not supported "
                        f"for {mt}")
    rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

    if mt == "qwen3_moe":
      step = int(get("decoder_sparse_step", default=1))
      only = set(get("mlp_only_layers", default=[]) or [])
      sparse = tuple((i not in only) and step > 0 and (i + 1) % step == 0 for i in range(layers))
      kw = dict(moe_intermediate_size=int(get("moe_intermediate_size")),
                intermediate_size=int(get("intermediate_size", default=0)),
                norm_topk_prob=bool(get("norm_topk_prob", default=False)),
                qk_norm="head", rms_norm_eps=float(get("rms_norm_eps", default=1e-6)))
    elif mt == "mixtral":
      inter = int(get("intermediate_size"))
      kw = dict(moe_intermediate_size=inter, intermediate_size=inter, norm_topk_prob=True,
                qk_norm="none", rms_norm_eps=float(get("rms_norm_eps", default=1e-5)))
      sparse = (True,) * layers
    elif mt == "qwen3_next":
      from moejax.families import qwen3_next
      kw = qwen3_next.config_kwargs(d, get, layers)
      sparse = kw.pop("sparse_layers")
    elif mt == "gpt_oss":
      from moejax.families import gpt_oss
      kw = gpt_oss.config_kwargs(d, layers, source, ConfigError)
      rope_theta = kw.pop("rope_theta")
      sparse = (True,) * layers
    else:  # olmoe
      inter = int(get("intermediate_size"))
      kw = dict(moe_intermediate_size=inter, intermediate_size=inter,
                norm_topk_prob=bool(get("norm_topk_prob", default=False)),
                qk_norm="full", clip_qkv=d.get("clip_qkv"),
                rms_norm_eps=float(get("rms_norm_eps", default=1e-5)))
      sparse = (True,) * layers
    cfg = cls(model_type=mt, vocab_size=int(get("vocab_size")), hidden_size=hidden,
              num_layers=layers, num_heads=heads,
              num_kv_heads=int(get("num_key_value_heads", default=heads)),
              head_dim=head_dim, num_experts=experts,
              top_k=int(get("num_experts_per_tok", "top_k")),
              sparse_layers=sparse, rope_theta=rope_theta,
              max_position_embeddings=int(get("max_position_embeddings", default=4096)),
              tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
              attention_bias=bool(get("attention_bias", default=mt == "gpt_oss")),
              bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, **kw)
    return cfg.validate()

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
    if self.model_type != "qwen3_moe":
      raise ConfigError(f"export is only implemented for qwen3_moe, not {self.model_type}")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size or 4 * self.hidden_size,
        "moe_intermediate_size": self.moe_intermediate_size,
        "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
        "num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
        "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, s in enumerate(self.sparse_layers) if not s],
        "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias, "hidden_act": "silu",
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_ids[0] if self.eos_token_ids else None,
        "torch_dtype": "bfloat16", "use_sliding_window": False,
    }
