"""Mixtral's config (model_type ``mixtral``): every layer sparse, no q/k norm, gates
renormalised."""

from __future__ import annotations

from moejax.model.families.configs.base import (ConfigSpec, FamilyConfig, common_fields,
                                                require_default_rope)


class MixtralSpec(ConfigSpec):
  model_types = ("mixtral",)

  def config_fields(self, d, get, source):
    require_default_rope(d, source)
    inter = int(get("intermediate_size"))
    return dict(common_fields(d, get, source), moe_intermediate_size=inter,
                intermediate_size=inter, norm_topk_prob=True, qk_norm="none",
                sparse_layers=(True,) * int(get("num_hidden_layers")),
                rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
                family_config=FamilyConfig())


SPEC = MixtralSpec()
