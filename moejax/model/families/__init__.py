"""The registry of model families: model_type -> `Family` (see ``base.py``).

Adding a family: one file defining a `Family` subclass and ``FAMILY``, and one
line in `_FAMILIES` below (docs/design.md, "Adding a family").
"""

from __future__ import annotations

from moejax.model.families import glm, gpt_oss, mixtral, olmoe, qwen3_moe, qwen3_next
from moejax.model.families.base import ConfigError, Family

_FAMILIES = (
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    olmoe.FAMILY,
    qwen3_next.FAMILY,
    glm.FAMILY,
    gpt_oss.FAMILY,
)

REGISTRY: dict[str, Family] = {t: f for f in _FAMILIES for t in f.model_types}
MODEL_TYPES: tuple[str, ...] = tuple(REGISTRY)


def get(model_type: str, source: str = "config.json") -> Family:
  """The family of `model_type`; a ConfigError naming the supported ones otherwise."""
  if not isinstance(model_type, str) or model_type not in REGISTRY:
    raise ConfigError(f"{source}: unknown or unsupported model_type {model_type!r}; "
                      f"supported: {', '.join(MODEL_TYPES)}")
  return REGISTRY[model_type]


def of(cfg) -> Family:
  """The family of a ModelConfig."""
  return get(cfg.model_type)


def router_rules() -> dict:
  """Router rules the families contribute: name -> (route, rank_scores)."""
  return {name: fns for f in _FAMILIES for name, fns in f.router_rules.items()}


def for_experts(w: dict) -> Family:
  """The family whose expert layout the dict `w` has (the plain SwiGLU one by default)."""
  for f in _FAMILIES:
    if f.expert_ffn is not None and f.is_expert_dict(w):
      return f
  return qwen3_moe.FAMILY
