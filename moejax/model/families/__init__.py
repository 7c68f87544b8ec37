"""The registry of model families: model_type -> `Family` (see ``base.py``).

A family has two halves: ``configs/<name>.py`` reads its config.json into ModelConfig
and its frozen sub-config (plain Python, imported by ``moejax.model.config``), and
``<name>.py`` builds its Flax modules.  The layer halves are imported on the first
lookup, so importing this package (or ``configs``) loads no jax or flax.

Adding a family: the two files, one line in ``configs/__init__.py``'s `_SPECS` and one
in `_families` below (docs/design.md, "Adding a family").
"""

from __future__ import annotations

import functools

from moejax.model.families.configs import MODEL_TYPES  # pylint: disable=unused-import
from moejax.model.families.configs import get as get_spec


@functools.cache
def _families() -> tuple:
  # pylint: disable=g-import-not-at-top
  from moejax.model.families import glm, gpt_oss, mixtral, olmoe, qwen3_moe, qwen3_next
  return (qwen3_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY, qwen3_next.FAMILY, glm.FAMILY,
          gpt_oss.FAMILY)


@functools.cache
def _registry() -> dict:
  return {t: f for f in _families() for t in f.model_types}


def get(model_type: str, source: str = "config.json"):
  """The family of `model_type`; a ConfigError naming the supported ones otherwise."""
  get_spec(model_type, source)
  return _registry()[model_type]


def of(cfg):
  """The family of a ModelConfig."""
  return get(cfg.model_type)


def router_rules() -> dict:
  """Router rules the families contribute: name -> `base.RouterRule` (route, rank_scores)."""
  return {name: fns for f in _families() for name, fns in f.router_rules.items()}


def for_experts(w: dict):
  """The family whose expert layout the dict `w` has (the plain SwiGLU one by default)."""
  for f in _families():
    if f.expert_ffn is not None and f.is_expert_dict(w):
      return f
  return _families()[0]
