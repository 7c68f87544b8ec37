"""OLMoE's config (model_type ``olmoe``): Mixtral's layout (every layer sparse) with q/k
RMSNorm over the whole projection (``qk_norm="full"``), optional q/k/v clipping
(``clip_qkv``) and ``norm_topk_prob`` from the config (default: not renormalised)."""

from __future__ import annotations

from moejax.model.families.configs.mixtral import MixtralSpec


class OlmoeSpec(MixtralSpec):
  model_types = ("olmoe",)

  def config_fields(self, d, get, source):
    return dict(super().config_fields(d, get, source),
                norm_topk_prob=bool(get("norm_topk_prob", default=False)),
                qk_norm="full", clip_qkv=d.get("clip_qkv"))


SPEC = OlmoeSpec()
