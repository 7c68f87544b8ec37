"""The config half of every family: model_type -> `ConfigSpec` (see ``base.py``).

Plain Python: importing this package loads neither jax nor flax nor the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moejax.model.families.configs import glm, gpt_oss, mixtral, olmoe, qwen3_moe, qwen3_next
from moejax.model.families.configs.base import ConfigError, ConfigSpec, FamilyConfig

_SPECS = (qwen3_moe.SPEC, mixtral.SPEC, olmoe.SPEC, qwen3_next.SPEC, glm.SPEC, gpt_oss.SPEC)

REGISTRY: dict[str, ConfigSpec] = {t: s for s in _SPECS for t in s.model_types}
MODEL_TYPES: tuple[str, ...] = tuple(REGISTRY)


def get(model_type: str, source: str = "config.json") -> ConfigSpec:
  """The config rules of `model_type`; a ConfigError naming the supported ones otherwise."""
  if not isinstance(model_type, str) or model_type not in REGISTRY:
    raise ConfigError(f"{source}: unknown or unsupported model_type {model_type!r}; "
                      f"supported: {', '.join(MODEL_TYPES)}")
  return REGISTRY[model_type]


def family_field_defaults() -> dict[str, Any]:
  """Every family sub-config field at its default, one level (names are unique across
  families): the fields ModelConfig itself held before they moved to sub-configs."""
  out: dict[str, Any] = {}
  for cls in dict.fromkeys(s.config_cls for s in _SPECS):
    for f in dataclasses.fields(cls):
      if f.name in out:
        raise ValueError(f"family config field {f.name!r} is defined by two families")
      out[f.name] = f.default
  return out
