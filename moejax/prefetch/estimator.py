"""A lightweight next-layer router-logit estimator.

Given the quasi-hidden state q_l (already normalised by layer l+1's pre-MoE norm) and the
plain quasi prediction router_{l+1}(q_l), the estimator adds a learned correction:

    logits_hat = router_{l+1}(q_l) + W_out silu(W_in u),   u = q_l  or  [q_l, p_prev]

where p_prev = softmax(layer l+1's true router logits at the previous token) (zeros at a
sequence's first token): the engine knows it at layer l, and on a model whose routing
repeats from token to token it carries what q_l cannot (docs/prefetch.md).  Which input
an estimator takes is read off its first kernel (D or D + E' rows: `takes_previous`).

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
  def __call__(self, u_NxD: jax.Array, base_NxE: jax.Array) -> jax.Array:
    chex.assert_rank([u_NxD, base_NxE], 2)
    chex.assert_equal_shape_prefix([u_NxD, base_NxE], 1)
    chex.assert_axis_dimension(base_NxE, 1, self.num_experts)
    h = nn.silu(nn.Dense(self.hidden, name="w_in")(u_NxD.astype(jnp.float32)))
    corr = nn.Dense(self.num_experts, kernel_init=nn.initializers.zeros, name="w_out")(h)
    return base_NxE.astype(jnp.float32) + corr


def previous_input(last_NxE: jax.Array, has_N: jax.Array) -> jax.Array:
  """p_prev: softmax of the previous token's router logits at the predicted layer, zeros
  where there is no previous token (`has` False)."""
  p = jax.nn.softmax(last_NxE.astype(jnp.float32), axis=-1)
  return jnp.where(jnp.asarray(has_N).reshape(-1, 1), p, 0.0)


def takes_previous(params, hidden_size: int) -> bool:
  """Whether an estimator's input is [q, p_prev] (its w_in kernel has more rows than q)."""
  return params["params"]["w_in"]["kernel"].shape[0] > hidden_size


def estimate(params, q_NxD: jax.Array, base_NxE: jax.Array, last_NxE: jax.Array | None = None,
             has_N: jax.Array | None = None) -> jax.Array:
  """The estimator's logits from q (and the previous token's logits where it takes them)."""
  hidden = params["params"]["w_in"]["kernel"].shape[-1]
  u = q_NxD.astype(jnp.float32)
  if takes_previous(params, q_NxD.shape[-1]):
    if last_NxE is None:
      raise ValueError("this estimator takes the previous token's router logits "
                       "(input width D + E'); none were given")
    u = jnp.concatenate([u, previous_input(last_NxE, has_N)], axis=-1)
  return LogitCorrection(base_NxE.shape[-1], hidden).apply(params, u, base_NxE)
