"""Qwen3-MoE (model_type ``qwen3_moe``): the layout the `Family` defaults describe.

Per-head q/k RMSNorm, RoPE over the whole head, a softmax router ``mlp.gate``
(top-k, renormalised when ``norm_topk_prob``), SwiGLU experts stored per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) or fused (transformers v5).
The config rules and the export are in ``configs/qwen3_moe.py``.
"""

from __future__ import annotations

from moejax.model.families.base import Family


class Qwen3Moe(Family):
  model_types = ("qwen3_moe",)


FAMILY = Qwen3Moe()
