"""The config of GLM-4.5 (glm4_moe), GLM-4.7-Flash (glm4_moe_lite) and DeepSeek-V3 (deepseek_v3).

Shared by the three: the sigmoid router with group-limited top-k (``n_group``,
``topk_group``, ``routed_scaling_factor``), ungated shared experts, the first layers
dense, and multi-token-prediction layers on the hub that moejax skips.  glm4_moe_lite
and deepseek_v3 use multi-head latent attention (MLA: ``kv_lora_rank`` > 0), with YaRN
in ``ModelConfig.rope_scaling``; glm4_moe uses GQA with ``partial_rotary_factor`` (both
shared ModelConfig fields).  `GlmConfig` holds the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moejax.model.families.configs.base import (ConfigError, ConfigSpec, FamilyConfig,
                                                checked_rope_type, eos_ids)

MODEL_TYPES = ("glm4_moe", "glm4_moe_lite", "deepseek_v3")
MLA_TYPES = ("glm4_moe_lite", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class GlmConfig(FamilyConfig):
  """Group-limited sigmoid routing, shared experts, MTP layers and the MLA sizes."""
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
  def hub_extra_layers(self) -> int:
    return self.num_mtp_layers


def config_fields(d: dict[str, Any], get, source: str) -> dict[str, Any]:
  """ModelConfig fields for one of MODEL_TYPES from a config.json dict (hub or v5 spelling)."""
  mt = d["model_type"]

  hidden = int(get("hidden_size"))
  heads = int(get("num_attention_heads"))
  layers = int(get("num_hidden_layers"))
  experts = int(get("n_routed_experts", "num_local_experts", "num_experts"))
  rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
  rope_type = checked_rope_type(rope, source, mt,
                                ("default", "yarn") if mt in MLA_TYPES else ("default",))
  rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
  yarn = (tuple(sorted((str(k), v) for k, v in rope.items() if k != "rope_theta" and (
      isinstance(v, (int, float, str, bool)) or v is None))) if rope_type == "yarn" else ())
  partial = float(rope.get("partial_rotary_factor",
                           d.get("partial_rotary_factor", 0.5 if mt == "glm4_moe" else 1.0)))
  for f, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
    if d.get(f) not in (None, ok):   # DeepSeek hub configs name the rule moejax implements
      raise ConfigError(f"{source}: field '{f}' is {d[f]!r}; only {ok!r} routing is "
                        f"implemented for {mt}")

  sparse = _sparse_layers(get, source, mt, layers)
  kv_heads, head_dim, qk_norm, mla = _attention(d, get, source, mt, hidden, heads, partial)
  return dict(vocab_size=int(get("vocab_size")), hidden_size=hidden,
              num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
              num_experts=experts, top_k=int(get("num_experts_per_tok")),
              moe_intermediate_size=int(get("moe_intermediate_size")),
              intermediate_size=int(get("intermediate_size")), sparse_layers=sparse,
              norm_topk_prob=bool(get("norm_topk_prob", default=True)),
              rms_norm_eps=float(get("rms_norm_eps",
                                     default=1e-5 if mt != "deepseek_v3" else 1e-6)),
              rope_theta=rope_theta, rope_scaling=yarn,
              max_position_embeddings=int(get("max_position_embeddings", default=4096)),
              tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
              attention_bias=bool(get("attention_bias", default=False)),
              qk_norm=qk_norm, router="sigmoid_group",
              bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids(d),
              partial_rotary_factor=partial,
              family_config=GlmConfig(
                  n_group=int(get("n_group", default=1)),
                  topk_group=int(get("topk_group", default=1)),
                  routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
                  n_shared_experts=int(get("n_shared_experts", default=1)),   # HF default
                  num_mtp_layers=int(get("num_nextn_predict_layers", "num_mtp_layers",
                                         default=1)),
                  **mla))


def _sparse_layers(get, source: str, mt: str, layers: int) -> tuple[bool, ...]:
  """Which layers route to experts: glm4_moe_lite lists them (mlp_layer_types); the others
  keep the first first_k_dense_replace layers dense."""
  if mt == "glm4_moe_lite":
    types = get("mlp_layer_types", default=None)
    if types is None:
      types = ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers or any(t not in ("dense", "sparse") for t in types):
      raise ConfigError(f"{source}: field 'mlp_layer_types' must list 'dense' or 'sparse' for "
                        f"each of the {layers} layers, got {types}")
    return tuple(t == "sparse" for t in types)
  k_dense = int(get("first_k_dense_replace", default=1 if mt == "glm4_moe" else 3))
  return tuple(i >= k_dense for i in range(layers))


def _attention(d: dict[str, Any], get, source: str, mt: str, hidden: int, heads: int,
               partial: float) -> tuple[int, int, str, dict[str, Any]]:
  """(kv heads, q/k head size, qk_norm, the MLA fields of GlmConfig: {} unless multi-head
  latent attention)."""
  kv_heads = int(get("num_key_value_heads", default=heads))
  if mt not in MLA_TYPES:
    if d.get("head_dim") is None and hidden % heads:
      raise ConfigError(f"{source}: field 'num_attention_heads' ({heads}) does not divide "
                        f"'hidden_size' ({hidden}) and no 'head_dim' is given")
    head_dim = int(get("head_dim", default=hidden // heads))
    return kv_heads, head_dim, "head" if bool(get("use_qk_norm", default=False)) else "none", {}
  if kv_heads != heads:
    raise ConfigError(f"{source}: field 'num_key_value_heads' ({kv_heads}) must equal "
                      f"'num_attention_heads' ({heads}) for multi-head latent attention")
  q_lora = d.get("q_lora_rank")
  rope_dim = int(get("qk_rope_head_dim"))
  if int(rope_dim * partial) != rope_dim:
    raise ConfigError(f"{source}: field 'partial_rotary_factor' ({partial}) must be 1 for "
                      f"{mt}: the rotary part is the whole qk_rope_head_dim")
  mla = dict(q_lora_rank=None if q_lora is None else int(q_lora),
             kv_lora_rank=int(get("kv_lora_rank")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
             qk_rope_head_dim=rope_dim, v_head_dim=int(get("v_head_dim")),
             rope_interleave=bool(get("rope_interleave", default=True)))
  return kv_heads, mla["qk_nope_head_dim"] + rope_dim, "none", mla   # the q/k head size


def validate(cfg: Any, need) -> None:
  """Family checks called from ModelConfig.validate (``need(cond, field, msg)``)."""
  fc = cfg.family_config
  e, g = cfg.num_experts, fc.n_group
  need(g > 0 and e % g == 0, "n_group", f"{g} groups do not divide {e} experts")
  need(g == 1 or e // g >= 2, "n_group",
       f"group-limited routing ranks groups by their top-2 scores; {e // max(g, 1)} expert(s) "
       "per group")
  need(0 < fc.topk_group <= g, "topk_group", f"must be in [1, n_group={g}], got {fc.topk_group}")
  need(cfg.top_k <= fc.topk_group * (e // g), "num_experts_per_tok",
       f"top-k {cfg.top_k} exceeds the {fc.topk_group * (e // g)} experts of the "
       f"{fc.topk_group} selected group(s)")
  need(fc.routed_scaling_factor > 0, "routed_scaling_factor",
       f"must be positive, got {fc.routed_scaling_factor}")
  if cfg.model_type in MLA_TYPES:
    for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      need(getattr(fc, f) > 0, f, f"must be positive for MLA, got {getattr(fc, f)}")
    need(fc.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")


class GlmSpec(ConfigSpec):
  model_types = MODEL_TYPES
  config_cls = GlmConfig

  def config_fields(self, d, get, source):
    return config_fields(d, get, source)

  def validate(self, cfg, need):
    validate(cfg, need)


SPEC = GlmSpec()
