"""GPT-OSS's config (model_type ``gpt_oss``): sliding layers, YaRN RoPE, clamped SwiGLU experts.

``ModelConfig.layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"`` and
``ModelConfig.rope_scaling`` holds the YaRN parameters (shared fields); `GptOssConfig`
holds the window and the expert activation's constants.  Expert shapes cover the float
and the MXFP4 layout (see ``moejax.model.families.gpt_oss``).
"""

from __future__ import annotations

import dataclasses

from moejax.model.families.configs.base import (ConfigError, ConfigSpec, FamilyConfig,
                                                checked_rope_type, common_fields)

MODEL_TYPE = "gpt_oss"
ROUTER = "topk_softmax"
DEFAULT_ROPE_THETA = 150000.0
# transformers' GptOssConfig default when a config names no rope scaling.
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
MXFP4_BLOCK = 32   # values per shared exponent (the codec: families/mxfp4.py)
MXFP4_BYTES_PER_BLOCK = MXFP4_BLOCK // 2  # two FP4 codes per byte


@dataclasses.dataclass(frozen=True)
class GptOssConfig(FamilyConfig):
  """The sliding window and the clamped-SwiGLU constants of the experts."""
  sliding_window: int | None = None  # "sliding_attention" layers: keys with position > q - window
  swiglu_alpha: float = 1.702        # clamped SwiGLU experts: gate * sigmoid(alpha * gate)
  swiglu_limit: float = 7.0          # gate <= limit, -limit <= up <= limit


def config_fields(d: dict, get, source: str) -> dict:
  """ModelConfig fields for a gpt_oss config.json (hub and transformers-v5 spellings)."""
  error = ConfigError
  fields = common_fields(d, get, source)
  num_layers = fields["num_layers"]
  inter = d.get("intermediate_size")
  if inter is None:
    raise error(f"{source}: missing field 'intermediate_size'")
  window = d.get("sliding_window")
  types = d.get("layer_types")
  if types is None:  # GptOssConfig default: even layers sliding, odd layers full
    types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
  if len(types) != num_layers:
    raise error(f"{source}: field 'layer_types' has {len(types)} entries for "
                f"{num_layers} layers")
  if window is not None and int(window) <= 0:
    raise error(f"{source}: field 'sliding_window' must be positive, got {window}")
  bad = sorted(set(types) - {"sliding_attention", "full_attention"})
  if bad:
    raise error(f"{source}: field 'layer_types': unsupported attention type {bad[0]!r}")
  rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or DEFAULT_YARN)
  theta = float(rope.pop("rope_theta", d.get("rope_theta") or DEFAULT_ROPE_THETA))
  checked_rope_type(rope, source, MODEL_TYPE, ("default", "yarn"))
  scaling = tuple(sorted((str(k), v) for k, v in rope.items()
                         if isinstance(v, (int, float, str, bool)) or v is None))
  return dict(
      fields, sparse_layers=(True,) * num_layers,
      attention_bias=bool(get("attention_bias", default=True)),
      moe_intermediate_size=int(inter), intermediate_size=int(inter), norm_topk_prob=True,
      qk_norm="none", rms_norm_eps=float(d.get("rms_norm_eps") or 1e-5),
      router=ROUTER, rope_theta=theta, layer_types=tuple(types), rope_scaling=scaling,
      family_config=GptOssConfig(
          sliding_window=None if window is None else int(window),
          swiglu_alpha=float(d.get("swiglu_alpha") or 1.702),
          swiglu_limit=float(d.get("swiglu_limit") or 7.0)))


def expert_shapes(cfg, fmt: str = "float") -> dict[str, tuple[int, ...]]:
  """Per-expert tensor shapes (no expert axis) for `fmt` 'float' or 'mxfp4'."""
  d, i = cfg.hidden_size, cfg.moe_intermediate_size
  if fmt == "float":
    return {"gate_up": (2 * i, d), "gate_up_bias": (2 * i,), "down": (d, i), "down_bias": (d,)}
  blk = MXFP4_BYTES_PER_BLOCK
  gd, gi = d // MXFP4_BLOCK, i // MXFP4_BLOCK
  return {"gate_up_blocks": (2 * i, gd, blk), "gate_up_scales": (2 * i, gd),
          "gate_up_bias": (2 * i,), "down_blocks": (d, gi, blk), "down_scales": (d, gi),
          "down_bias": (d,)}


class GptOssSpec(ConfigSpec):
  model_types = (MODEL_TYPE,)
  config_cls = GptOssConfig

  def config_fields(self, d, get, source):
    return config_fields(d, get, source)

  def expert_shapes(self, cfg, fmt="float"):
    return expert_shapes(cfg, fmt)


SPEC = GptOssSpec()
