"""Mixtral (model_type ``mixtral``): every layer sparse, no q/k norm, gates renormalised.

Hub tensors live under ``block_sparse_moe`` with experts ``w1`` (gate), ``w3``
(up) and ``w2`` (down); `rename_tensor` maps them to the Qwen3-MoE names.
The config rules are in ``configs/mixtral.py``.
"""

from __future__ import annotations

import re

from moejax.model.families.base import Family

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Mixtral(Family):
  model_types = ("mixtral",)

  def rename_tensor(self, name):
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])(\.weight)$",
                  lambda m: m.group(1) + _EXPERT_NAMES[m.group(2)] + m.group(3), name)


FAMILY = Mixtral()
