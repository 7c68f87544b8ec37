"""Routed expert computation from explicitly passed expert weights.

The model never owns routed experts: callers pass a dict of stacked arrays
``{"gate_up": [E, 2I, D], "down": [E, D, I]}`` (the full table, or the offload
engine's slot buffers, in which case ``ids`` are slot indices).  A family with
another expert layout (``Family.expert_ffn``, e.g. GPT-OSS's biased, clamped
SwiGLU) is recognised by its dict's keys (``families.for_experts``).

On the CPU backend, plain (non-gpt_oss) experts in f32/bf16 run through the C++
kernel of ``moejax.kernels.cpu_kernel`` (in place, both cores); elsewhere, or without a
compiler, two exact XLA dispatch strategies, chosen statically from the token count
(experts held as ggml blocks go through `quant_ops`: a kernel where one takes them, else
these, each selected expert dequantized in the program):
  * sliced: one dynamic slice + matvec per (token, expert) pair; for decode (up to 64
    pairs, or 8 for a family's own expert layout).
  * grouped: sorts (token, expert) pairs by expert into blocks of B rows, each
    block owned by one expert, and runs one batched matmul over the blocks.
    Static shapes, no token is ever dropped; used for prefill and training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import cpu_kernel
from moejax.kernels import cpu_matmul
from moejax.model import families
from moejax.model import quant_ops

ExpertWeights = dict  # {"gate_up": [E, 2I, D], "down": [E, D, I]}, or a family's own layout
SLICED_MAX_PAIRS = 64   # up to this many (token, expert) pairs: the sliced path
# A family's own expert (gpt_oss: MXFP4 dequantised per pair) unrolls into a much larger
# program: at 16 pairs the sliced path compiled in 2 s and ran slower than grouped, at 64
# pairs 21 s (docs/lab/notes/cpu_speed.md, "Sliced experts of a family's own layout").
FAMILY_SLICED_MAX_PAIRS = 8
SWIGLU = (1.702, 7.0)  # gpt_oss clamped-SwiGLU (alpha, limit) unless the caller passes cfg's


def _num_experts(w: ExpertWeights) -> int:
  return next(iter(w.values())).shape[0]


def experts_sliced(x_NxD, ids_NxK, gates_NxK, w: ExpertWeights, swiglu=SWIGLU):
  """Unrolled over the N*K (token, expert) pairs: each expert's matvecs read its weights
  in place through a dynamic slice (XLA CPU fuses it into the dot), instead of first
  gathering copies of the selected experts (faster on CPU for a decode token)."""
  n, k = ids_NxK.shape
  ffn = families.for_experts(w).expert_ffn
  rows = []
  for i in range(n):
    acc = None
    for j in range(k):
      e = ids_NxK[i, j]
      if ffn is not None:  # the family's own expert (e.g. MXFP4 dequantised for it only)
        we = {kk: jax.lax.dynamic_index_in_dim(v, e, keepdims=True) for kk, v in w.items()}
        y = ffn(x_NxD[i][None, None], we, *swiglu)[0, 0]
      else:  # plain matvecs: XLA CPU reads the sliced weights in place
        gu_2IxD = quant_ops.take_gate_up(w, e)     # (QuantArrays: dequantized)
        dn_DxI = quant_ops.take(w["down"], e)
        h = gu_2IxD @ x_NxD[i]
        half = h.shape[0] // 2
        y = dn_DxI @ (jax.nn.silu(h[:half]) * h[half:])
      y = y * gates_NxK[i, j].astype(y.dtype)
      acc = y if acc is None else acc + y
    rows.append(acc)
  return jnp.stack(rows)


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

  ffn = families.for_experts(w).expert_ffn
  if ffn is not None:
    yb = ffn(xb, {kk: v[block_e] for kk, v in w.items()}, *swiglu)
  else:
    h = jnp.einsum("nbd,nid->nbi", xb, quant_ops.gather_gate_up(w, block_e))
    g, u = jnp.split(h, 2, axis=-1)
    yb = jnp.einsum("nbi,ndi->nbd", jax.nn.silu(g) * u, quant_ops.gather(w["down"], block_e))
  y = yb.reshape(rows, -1)[dest].reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y, gates_NxK.astype(y.dtype))


def apply_experts(x_NxD, ids_NxK, gates_NxK, w: ExpertWeights, swiglu=SWIGLU):
  """Exact weighted sum of the selected experts' outputs, [N, D].

  ``swiglu`` = (alpha, limit) passed to a family's ``expert_ffn`` (gpt_oss's clamped
  SwiGLU; unused by plain SwiGLU experts).
  """
  w = quant_ops.expert_weights(w, x_NxD.dtype)     # a quantized store's blocks
  if any(quant_ops.is_quant(v) for v in w.values()):
    return quant_ops.experts(x_NxD, ids_NxK, gates_NxK, w, xla_experts)
  # plain SwiGLU experts only: cpu_matmul.supports checks for exactly {"gate_up", "down"}
  if cpu_matmul.supports(x_NxD, w) and cpu_kernel.available():
    return cpu_matmul.expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_experts)
  return xla_experts(x_NxD, ids_NxK, gates_NxK, w, swiglu=swiglu)


def xla_experts(x_NxD, ids_NxK, gates_NxK, w: ExpertWeights, swiglu=SWIGLU):
  """`apply_experts` in XLA alone: sliced for a few pairs, else grouped."""
  n, k = ids_NxK.shape
  own = families.for_experts(w).expert_ffn is not None
  if n * k <= (FAMILY_SLICED_MAX_PAIRS if own else SLICED_MAX_PAIRS):
    return experts_sliced(x_NxD, ids_NxK, gates_NxK, w, swiglu=swiglu)
  return experts_grouped(x_NxD, ids_NxK, gates_NxK, w, swiglu=swiglu)
