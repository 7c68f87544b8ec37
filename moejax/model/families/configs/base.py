"""The config half of a family: config.json -> ModelConfig fields and the family's sub-config.

Every module under ``moejax/model/families/configs/`` is plain Python (no jax, no flax),
so ``moejax.model.config`` can read, check and hash configs without loading the model
code.  A family's config module defines

  ``<Name>Config``  a frozen `FamilyConfig` subclass: the fields only that family reads
                    (``ModelConfig.family_config``); families without any use `FamilyConfig`.
  ``SPEC``          a `ConfigSpec`: ``config_fields(d, get, source)`` (every ModelConfig
                    field but ``model_type``, ``family_config`` included), ``validate(cfg,
                    need)``, ``expert_shapes(cfg, fmt)`` and ``to_hf_dict(cfg)``.

The defaults below are the Qwen3-MoE ones; the layer half (``families/<name>.py``) builds
the Flax modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


class ConfigError(ValueError):
  """A config.json that moejax cannot use; the message names the field."""


@dataclasses.dataclass(frozen=True)
class FamilyConfig:
  """The fields of one family that no other family reads (none for this base)."""

  @property
  def hub_extra_layers(self) -> int:
    """Hub layers after the decoder stack that moejax does not run (multi-token prediction);
    their tensors are skipped on load."""
    return 0


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


def eos_ids(d: dict[str, Any]) -> tuple[int, ...]:
  eos = d.get("eos_token_id")
  return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))


def common_fields(d: dict[str, Any], get, source: str) -> dict[str, Any]:
  """The ModelConfig fields most families spell the same way (hub or v5 spelling)."""
  hidden = int(get("hidden_size"))
  heads = int(get("num_attention_heads"))
  if d.get("head_dim") is None and hidden % heads:
    raise ConfigError(
        f"{source}: field 'num_attention_heads' ({heads}) does not divide "
        f"'hidden_size' ({hidden}) and no 'head_dim' is given")
  rope = d.get("rope_parameters") or {}
  return dict(
      vocab_size=int(get("vocab_size")), hidden_size=hidden,
      num_layers=int(get("num_hidden_layers")), num_heads=heads,
      num_kv_heads=int(get("num_key_value_heads", default=heads)),
      head_dim=int(get("head_dim", default=hidden // heads)),
      num_experts=int(get("num_experts", "num_local_experts")),
      top_k=int(get("num_experts_per_tok", "top_k")),
      rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
      max_position_embeddings=int(get("max_position_embeddings", default=4096)),
      tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
      attention_bias=bool(get("attention_bias", default=False)),
      bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids(d))


def require_default_rope(d: dict[str, Any], source: str):
  """ConfigError unless the config asks for plain RoPE (no scaling)."""
  rope, scaling = d.get("rope_parameters") or {}, d.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
  if rope_type not in ("default", None):
    raise ConfigError(f"{source}: field 'rope_scaling': rope type {rope_type!r} is not "
                      f"supported for {d.get('model_type')}")


def checked_rope_type(rope: dict[str, Any], source: str, model_type: str,
                      allowed: tuple[str, ...]) -> str:
  """The rope type of a config's rope dict (a legacy ``type`` key renamed ``rope_type`` in
  place), ConfigError unless it is one of `allowed` or when YaRN lacks a required field."""
  if "type" in rope and "rope_type" not in rope:
    rope["rope_type"] = rope.pop("type")
  rope_type = rope.get("rope_type") or "default"
  if rope_type not in allowed:
    raise ConfigError(f"{source}: field 'rope_scaling': rope type {rope_type!r} is not supported "
                      f"for {model_type} (supported: {', '.join(allowed)})")
  if rope_type == "yarn":
    for f in ("factor", "original_max_position_embeddings"):
      if rope.get(f) is None:
        raise ConfigError(f"{source}: field 'rope_scaling.{f}' is required for YaRN")
  return rope_type


def decoder_sparse_layers(get, num_layers: int) -> tuple[bool, ...]:
  """Qwen's per-layer sparsity: every `decoder_sparse_step`-th layer, minus `mlp_only_layers`."""
  step = int(get("decoder_sparse_step", default=1))
  only = set(get("mlp_only_layers", default=[]) or [])
  return tuple((i not in only) and step > 0 and (i + 1) % step == 0 for i in range(num_layers))


class ConfigSpec:
  """The Qwen3-MoE config rules; subclasses override what their config.json does differently."""

  model_types: tuple[str, ...] = ()
  config_cls: type[FamilyConfig] = FamilyConfig

  def config_fields(self, d: dict[str, Any], get, source: str) -> dict[str, Any]:
    """Every ModelConfig field but ``model_type`` (``family_config`` included) from `d`."""
    require_default_rope(d, source)
    fields = common_fields(d, get, source)
    fields.update(
        sparse_layers=decoder_sparse_layers(get, fields["num_layers"]),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        intermediate_size=int(get("intermediate_size", default=0)),
        norm_topk_prob=bool(get("norm_topk_prob", default=False)),
        qk_norm="head", rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
        family_config=self.config_cls())
    return fields

  def validate(self, cfg, need: Callable) -> None:
    """Family checks; ``need(cond, field, msg)`` raises a ConfigError naming the field."""
    del cfg, need

  def expert_shapes(self, cfg, fmt: str = "float") -> dict[str, tuple[int, ...]]:
    """Per-expert tensor shapes (no expert axis) of the expert dict in format `fmt`."""
    if fmt != "float":
      raise ValueError(f"{cfg.model_type} experts have no {fmt!r} format")
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_up": (2 * i, d), "down": (d, i)}

  def to_hf_dict(self, cfg) -> dict[str, Any]:
    """The hub config.json of `cfg` (exporting a model)."""
    raise ConfigError(f"export is only implemented for qwen3_moe, not {cfg.model_type}")
