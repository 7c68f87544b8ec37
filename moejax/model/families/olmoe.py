"""OLMoE (model_type ``olmoe``): every layer sparse, q/k RMSNorm over the whole
projection (``qk_norm="full"``), optional q/k/v clipping (``clip_qkv``); the layers are
the `Family` defaults, the config rules are in ``configs/olmoe.py``."""

from __future__ import annotations

from moejax.model.families.base import Family


class Olmoe(Family):
  model_types = ("olmoe",)


FAMILY = Olmoe()
