"""The model-family interface: what a checkpoint family tells the rest of moejax.

A family is one `Family` object (one per file under ``moejax/model/families/``), listed
in the registry of ``moejax/model/families/__init__.py``.  Everything outside this
folder asks the family of a config (``families.of(cfg)``) instead of testing
``model_type``.  The defaults below are the Qwen3-MoE layout; a family overrides
what differs:

  config       ``config_fields(d, get, source)``: every ModelConfig field but
               ``model_type`` from a config.json dict (``common_fields`` parses the
               usual ones); ``validate(cfg, need)``: family checks.
  modules      ``norm``, ``mixer`` and ``mixer_name`` (the token mixer, its parameter name),
               ``sparse_mlp`` (the router of a sparse layer, plus an optional
               ``shared_output(x)`` method for shared experts), ``init_cache``,
               ``has_recurrent_state``.
  router rule  ``router_rules``: rule name -> (route, rank_scores) functions this
               family contributes (``moejax.model.routing`` dispatches on ``cfg.router``).
  experts      ``expert_shapes(cfg, fmt)``, ``is_expert_dict(w)``, and for a non
               SwiGLU layout ``expert_ffn`` (device, batched) and
               ``expert_forward_np`` (host, one expert).
  checkpoint   ``rename_tensor(name)``: hub spelling -> moejax's; ``load_layer_experts``:
               a layer's experts from a non-standard tensor layout (None: the
               generic per-expert or fused ``gate_up``/``down`` layout);
               ``to_hf_dict(cfg)``: the config.json to export (qwen3_moe only).

This module imports nothing of moejax but ``layers``, so ``moejax.model.config`` can
use the registry without an import cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from moejax.model.layers import Attention, RMSNorm, Router

PLAIN_EXPERT_KEYS = frozenset({"gate_up", "down"})


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


def decoder_sparse_layers(get, num_layers: int) -> tuple[bool, ...]:
  """Qwen's per-layer sparsity: every `decoder_sparse_step`-th layer, minus `mlp_only_layers`."""
  step = int(get("decoder_sparse_step", default=1))
  only = set(get("mlp_only_layers", default=[]) or [])
  return tuple((i not in only) and step > 0 and (i + 1) % step == 0 for i in range(num_layers))


class Family:
  """The Qwen3-MoE layout; subclasses override what their checkpoints do differently."""

  model_types: tuple[str, ...] = ()
  router_rules: dict[str, tuple[Callable, Callable]] = {}
  expert_ffn: Callable | None = None        # (x_NxBxD, w, alpha, limit) -> y; None: SwiGLU
  expert_forward_np: Callable | None = None  # (x_D, w) -> y on the host; None: SwiGLU
  load_layer_experts: Callable | None = None  # see moejax.io.loader; None: generic layouts

  # ------------------------------------------------------------------ config
  def config_fields(self, d: dict[str, Any], get, source: str) -> dict[str, Any]:
    require_default_rope(d, source)
    fields = common_fields(d, get, source)
    fields.update(
        sparse_layers=decoder_sparse_layers(get, fields["num_layers"]),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        intermediate_size=int(get("intermediate_size", default=0)),
        norm_topk_prob=bool(get("norm_topk_prob", default=False)),
        qk_norm="head", rms_norm_eps=float(get("rms_norm_eps", default=1e-6)))
    return fields

  def validate(self, cfg, need: Callable) -> None:
    """Family checks; ``need(cond, field, msg)`` raises a ConfigError naming the field."""
    del cfg, need

  # ----------------------------------------------------------------- modules
  def norm(self, cfg, dtype) -> nn.Module:
    return RMSNorm(cfg.rms_norm_eps, dtype)

  def mixer(self, cfg, layer_idx: int, dtype) -> nn.Module:
    """Layer `layer_idx`'s token mixer: ``module(x, positions, cache, end_index) -> (y, cache)``."""
    del layer_idx
    return Attention(cfg, dtype)

  def mixer_name(self, cfg, layer_idx: int) -> str:
    """The mixer's parameter name (the hub's: ``model.layers.{i}.self_attn...``)."""
    del cfg, layer_idx
    return "self_attn"

  def sparse_mlp(self, cfg, dtype) -> nn.Module:
    """The ``mlp`` of a sparse layer: called on the normed input it gives the router
    output; a ``shared_output(x)`` method, if any, is added to the routed sum."""
    return Router(cfg, dtype)

  def init_cache(self, cfg, batch: int, max_len: int, dtype=jnp.float32) -> list:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for _ in range(cfg.num_layers)]

  def has_recurrent_state(self, cfg) -> bool:
    """True when some layer's cache holds the whole past (a prefill must be unpadded)."""
    del cfg
    return False

  # ----------------------------------------------------------------- experts
  def expert_shapes(self, cfg, fmt: str = "float") -> dict[str, tuple[int, ...]]:
    """Per-expert tensor shapes (no expert axis) of the expert dict in format `fmt`."""
    if fmt != "float":
      raise ValueError(f"{cfg.model_type} experts have no {fmt!r} format")
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_up": (2 * i, d), "down": (d, i)}

  def is_expert_dict(self, w: dict) -> bool:
    """Whether `w` (one expert or a stack) has this family's expert layout."""
    return set(w) == PLAIN_EXPERT_KEYS

  # -------------------------------------------------------------- checkpoint
  def to_hf_dict(self, cfg) -> dict[str, Any]:
    """The hub config.json of `cfg` (exporting a model)."""
    raise ConfigError(f"export is only implemented for qwen3_moe, not {cfg.model_type}")

  def rename_tensor(self, name: str) -> str:
    """A hub tensor name in the spelling the loader parses (``model.layers.{i}.mlp...``)."""
    return name
