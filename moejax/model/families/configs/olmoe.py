"""OLMoE's config (model_type ``olmoe``): every layer sparse, q/k RMSNorm over the whole
projection (``qk_norm="full"``), optional q/k/v clipping (``clip_qkv``)."""

from __future__ import annotations

from moejax.model.families.configs.base import (ConfigSpec, FamilyConfig, common_fields,
                                                require_default_rope)


class OlmoeSpec(ConfigSpec):
  model_types = ("olmoe",)

  def config_fields(self, d, get, source):
    require_default_rope(d, source)
    inter = int(get("intermediate_size"))
    return dict(common_fields(d, get, source), moe_intermediate_size=inter,
                intermediate_size=inter, norm_topk_prob=bool(get("norm_topk_prob", default=False)),
                qk_norm="full", clip_qkv=d.get("clip_qkv"),
                sparse_layers=(True,) * int(get("num_hidden_layers")),
                rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
                family_config=FamilyConfig())


SPEC = OlmoeSpec()
