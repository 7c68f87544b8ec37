"""A lightweight next-layer router-logit estimator.

Given the quasi-hidden state q_l (already normalised by layer l+1's pre-MoE norm) and the
plain quasi prediction router_{l+1}(q_l), the estimator adds a learned correction:

    logits_hat = router_{l+1}(q_l) + W_out silu(W_in q_l)

W_out starts at zero, so an untrained estimator is exactly the quasi predictor and
training can only move away from it where the data says so.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp


class LogitCorrection(nn.Module):
  num_experts: int
  hidden: int = 64

  @nn.compact
  def __call__(self, q_NxD: jax.Array, base_NxE: jax.Array) -> jax.Array:
    chex.assert_rank([q_NxD, base_NxE], 2)
    chex.assert_equal_shape_prefix([q_NxD, base_NxE], 1)
    chex.assert_axis_dimension(base_NxE, 1, self.num_experts)
    h = nn.silu(nn.Dense(self.hidden, name="w_in")(q_NxD.astype(jnp.float32)))
    corr = nn.Dense(self.num_experts, kernel_init=nn.initializers.zeros, name="w_out")(h)
    return base_NxE.astype(jnp.float32) + corr
