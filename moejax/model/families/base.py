"""The model-family interface: what a checkpoint family tells the rest of moejax.

A family is one `Family` object (one per file under ``moejax/model/families/``), listed
in the registry of ``moejax/model/families/__init__.py``, and the config rules of
``families/configs/<name>.py`` (a `ConfigSpec`: config.json -> ModelConfig and the
family's sub-config ``cfg.family_config``; checks; expert shapes; export).  Everything
outside this folder asks the family of a config (``families.of(cfg)``) instead of testing
``model_type``.  The defaults below are the Qwen3-MoE layout; a family overrides what
differs:

  modules      ``norm``, ``mixer`` and ``mixer_name`` (the token mixer, its parameter name),
               ``sparse_mlp`` (the router of a sparse layer, plus an optional
               ``shared_output(x)`` method for shared experts), ``init_cache``,
               ``has_recurrent_state``.
  router rule  ``router_rules``: rule name -> `RouterRule` (route, rank_scores) this
               family contributes (``moejax.model.routing`` dispatches on ``cfg.router``).
  experts      ``expert_shapes(cfg, fmt)`` (the config rules'), ``is_expert_dict(w)``, and
               for a non SwiGLU layout ``expert_ffn`` (device, batched; ``swiglu(cfg)``
               gives its constants) and ``expert_forward_np`` (host, one expert).
  checkpoint   ``rename_tensor(name)``: hub spelling -> moejax's; ``load_layer_experts``:
               a layer's experts from a non-standard tensor layout (None: the
               generic per-expert or fused ``gate_up``/``down`` layout).

This module imports nothing of moejax but ``layers`` and ``configs``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import flax.linen as nn
import jax.numpy as jnp

from moejax.model.families import configs
from moejax.model.families.configs.base import ConfigError  # pylint: disable=unused-import
from moejax.model.layers import Attention, RMSNorm, Router

PLAIN_EXPERT_KEYS = frozenset({"gate_up", "down"})
SWIGLU = (1.702, 7.0)  # the clamped-SwiGLU constants of every published GPT-OSS checkpoint


class RouterRule(NamedTuple):
  """A router rule's two functions, read by name (`moejax.model.routing` dispatches on
  ``cfg.router``)."""
  route: Callable         # (cfg, f32 logits [N, R]) -> (ids [N, K], gates [N, K], scores [N, E])
  rank_scores: Callable   # (cfg, f32 logits [N, R]) -> [N, E]: what ranks substitutes


class Family:
  """The Qwen3-MoE layout; subclasses override what their checkpoints do differently."""

  model_types: tuple[str, ...] = ()
  router_rules: dict[str, RouterRule] = {}
  expert_ffn: Callable | None = None        # (x_NxBxD, w, alpha, limit) -> y; None: SwiGLU
  expert_forward_np: Callable | None = None  # (x_D, w) -> y on the host; None: SwiGLU
  load_layer_experts: Callable | None = None  # see moejax.io.loader; None: generic layouts

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
    return configs.get(cfg.model_type).expert_shapes(cfg, fmt)

  def swiglu(self, cfg) -> tuple[float, float]:
    """(alpha, limit) that ``expert_ffn`` takes (a clamped SwiGLU); unused without one."""
    del cfg
    return SWIGLU

  def is_expert_dict(self, w: dict) -> bool:
    """Whether `w` (one expert or a stack) has this family's expert layout."""
    return set(w) == PLAIN_EXPERT_KEYS

  # -------------------------------------------------------------- checkpoint
  def rename_tensor(self, name: str) -> str:
    """A hub tensor name in the spelling the loader parses (``model.layers.{i}.mlp...``)."""
    return name
