"""Qwen3-Next's config (model_type ``qwen3_next``): Gated DeltaNet layers and a gated
shared expert.

``ModelConfig.layer_types[i]`` is ``"linear_attention"`` (a Gated DeltaNet) or
``"full_attention"`` (gated attention, every 4th layer on the hub); RoPE covers the
first ``partial_rotary_factor * head_dim`` dims.  Both are shared ModelConfig fields;
`Qwen3NextConfig` holds the DeltaNet sizes and the shared expert.
"""

from __future__ import annotations

import dataclasses

from moejax.model.families.configs.base import (ConfigSpec, FamilyConfig, common_fields,
                                                decoder_sparse_layers, require_default_rope)

LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(FamilyConfig):
  """Gated DeltaNet sizes (layers of type "linear_attention") and the shared expert."""
  linear_conv_kernel_dim: int = 4
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  shared_expert_intermediate_size: int = 0  # sigmoid-gated shared expert (0 = none)


def rotary_dim(cfg) -> int:
  return int(cfg.head_dim * cfg.partial_rotary_factor)


class Qwen3NextSpec(ConfigSpec):
  model_types = ("qwen3_next",)
  config_cls = Qwen3NextConfig

  def config_fields(self, d, get, source):
    """ModelConfig fields of a qwen3_next config.json (hub and transformers-v5 spellings)."""
    require_default_rope(d, source)
    fields = common_fields(d, get, source)
    layers = fields["num_layers"]
    lt = d.get("layer_types")
    if lt is None:                                   # hub spelling
      interval = int(get("full_attention_interval", default=4))
      lt = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    rope = d.get("rope_parameters") or {}
    prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    return dict(
        fields, sparse_layers=decoder_sparse_layers(get, layers),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        intermediate_size=int(get("intermediate_size", default=0)),
        norm_topk_prob=bool(get("norm_topk_prob", default=True)),
        rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
        qk_norm="head", router="softmax",
        layer_types=tuple(str(x) for x in lt),
        partial_rotary_factor=float(prf),
        family_config=Qwen3NextConfig(
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", default=4)),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            shared_expert_intermediate_size=int(
                get("shared_expert_intermediate_size", default=0))))

  def validate(self, cfg, need):
    """Qwen3-Next checks; `need(cond, field, msg)` raises ConfigError naming the field."""
    fc = cfg.family_config
    need(len(cfg.layer_types) == cfg.num_layers, "layer_types",
         f"{len(cfg.layer_types)} entries for {cfg.num_layers} layers")
    bad = sorted(set(cfg.layer_types) - {LINEAR, FULL})
    need(not bad, "layer_types", f"unknown layer type(s) {bad}; expected {LINEAR!r} or {FULL!r}")
    need(0.0 < cfg.partial_rotary_factor <= 1.0, "partial_rotary_factor",
         f"must be in (0, 1], got {cfg.partial_rotary_factor}")
    need(rotary_dim(cfg) % 2 == 0 and rotary_dim(cfg) > 0, "partial_rotary_factor",
         f"gives an odd or empty rotary dim {rotary_dim(cfg)} of head_dim {cfg.head_dim}")
    if LINEAR in cfg.layer_types:
      for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim"):
        need(getattr(fc, f) > 0, f, f"must be positive, got {getattr(fc, f)}")
      need(fc.linear_num_value_heads % fc.linear_num_key_heads == 0, "linear_num_value_heads",
           f"{fc.linear_num_value_heads} value heads are not a multiple of "
           f"{fc.linear_num_key_heads} key heads")
    need(fc.shared_expert_intermediate_size > 0 or not any(cfg.sparse_layers),
         "shared_expert_intermediate_size", "must be positive for qwen3_next MoE layers")


SPEC = Qwen3NextSpec()
