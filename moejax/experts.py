"""Routed expert computation from explicitly passed expert weights.

The model never owns routed experts: callers pass a dict of stacked arrays
``{"gate_up": [E, 2I, D], "down": [E, D, I]}`` (the full table, or the offload
engine's slot buffers, in which case ``ids`` are slot indices).

Two exact dispatch strategies, chosen statically from the token count:
  * gather: gathers the K selected experts' weights per token; best for decode.
  * grouped: sorts (token, expert) pairs by expert into blocks of B rows, each
    block owned by one expert, and runs one batched matmul over the blocks.
    Static shapes, no token is ever dropped; used for prefill and training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.families import gpt_oss

ExpertWeights = dict  # {"gate_up": [E, 2I, D], "down": [E, D, I]}; gpt_oss: see families.gpt_oss
SWIGLU = (1.702, 7.0)  # gpt_oss clamped-SwiGLU (alpha, limit) unless the caller passes cfg's


def _num_experts(w: ExpertWeights) -> int:
  return gpt_oss.num_experts(w) if gpt_oss.is_expert_dict(w) else w["gate_up"].shape[0]


def _ffn(x_NxD, gate_up_Nx2IxD, down_NxDxI):
  h = jnp.einsum("nd,nid->ni", x_NxD, gate_up_Nx2IxD)
  g, u = jnp.split(h, 2, axis=-1)
  return jnp.einsum("ni,ndi->nd", jax.nn.silu(g) * u, down_NxDxI)


def experts_gather(x_NxD, ids_NxK, gates_NxK, w: ExpertWeights, swiglu=SWIGLU):
  n, k = ids_NxK.shape
  flat = ids_NxK.reshape(-1)
  x_rep = jnp.repeat(x_NxD, k, axis=0)
  if gpt_oss.is_expert_dict(w):  # biases, clamped SwiGLU; MXFP4 dequantised per gathered expert
    y = gpt_oss.expert_ffn(x_rep[:, None], {kk: v[flat] for kk, v in w.items()}, *swiglu)
    y = y.reshape(n, k, -1)
  else:
    y = _ffn(x_rep, w["gate_up"][flat], w["down"][flat]).reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y, gates_NxK.astype(y.dtype))


def block_size_for(num_assignments: int, num_experts: int) -> int:
  mean = max(1, num_assignments // max(1, num_experts))
  b = 8
  while b * 2 <= mean // 2 and b < 128:
    b *= 2
  return b


def experts_grouped(x_NxD, ids_NxK, gates_NxK, w: ExpertWeights, block: int | None = None,
                    swiglu=SWIGLU):
  n, k = ids_NxK.shape
  num_e = _num_experts(w)
  nk = n * k
  b = block or block_size_for(nk, num_e)
  num_blocks = -(-(nk + num_e * (b - 1)) // b)

  flat_e = ids_NxK.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  sorted_e = flat_e[order]
  counts = jnp.bincount(flat_e, length=num_e)
  padded = ((counts + b - 1) // b) * b
  pad_end = jnp.cumsum(padded)
  pad_start = pad_end - padded
  start = jnp.cumsum(counts) - counts
  rank = jnp.arange(nk) - start[sorted_e]
  dest_sorted = pad_start[sorted_e] + rank          # row of each sorted assignment
  dest = jnp.zeros((nk,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))

  rows = num_blocks * b
  tok = jnp.arange(nk) // k
  src = jnp.full((rows,), n, jnp.int32).at[dest].set(tok)
  x_pad = jnp.concatenate([x_NxD, jnp.zeros((1, x_NxD.shape[1]), x_NxD.dtype)], axis=0)
  xb = x_pad[src].reshape(num_blocks, b, -1)
  block_e = jnp.searchsorted(pad_end, jnp.arange(num_blocks) * b, side="right")
  block_e = jnp.minimum(block_e, num_e - 1)

  if gpt_oss.is_expert_dict(w):
    yb = gpt_oss.expert_ffn(xb, {kk: v[block_e] for kk, v in w.items()}, *swiglu)
  else:
    h = jnp.einsum("nbd,nid->nbi", xb, w["gate_up"][block_e])
    g, u = jnp.split(h, 2, axis=-1)
    yb = jnp.einsum("nbi,ndi->nbd", jax.nn.silu(g) * u, w["down"][block_e])
  y = yb.reshape(rows, -1)[dest].reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y, gates_NxK.astype(y.dtype))


def apply_experts(x_NxD, ids_NxK, gates_NxK, w: ExpertWeights, swiglu=SWIGLU):
  """Exact weighted sum of the selected experts' outputs, [N, D].

  ``swiglu`` = (alpha, limit) of gpt_oss expert dicts (ignored for the others).
  """
  n, k = ids_NxK.shape
  num_e = _num_experts(w)
  if n * k <= 2 * num_e or n <= 4:
    return experts_gather(x_NxD, ids_NxK, gates_NxK, w, swiglu=swiglu)
  return experts_grouped(x_NxD, ids_NxK, gates_NxK, w, swiglu=swiglu)
