"""Mixtral (model_type ``mixtral``): every layer sparse, no q/k norm, gates renormalised.

Hub tensors live under ``block_sparse_moe`` with experts ``w1`` (gate), ``w3``
(up) and ``w2`` (down); `rename_tensor` maps them to the Qwen3-MoE names.
"""

from __future__ import annotations

import re

from moejax.model.families.base import Family, require_default_rope, common_fields

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Mixtral(Family):
  model_types = ("mixtral",)

  def config_fields(self, d, get, source):
    require_default_rope(d, source)
    inter = int(get("intermediate_size"))
    return dict(common_fields(d, get, source), moe_intermediate_size=inter,
                intermediate_size=inter, norm_topk_prob=True, qk_norm="none",
                sparse_layers=(True,) * int(get("num_hidden_layers")),
                rms_norm_eps=float(get("rms_norm_eps", default=1e-5)))

  def rename_tensor(self, name):
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])(\.weight)$",
                  lambda m: m.group(1) + _EXPERT_NAMES[m.group(2)] + m.group(3), name)


FAMILY = Mixtral()
