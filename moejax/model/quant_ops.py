"""Weights held as ggml blocks (`moejax.ggml.qarray.QuantArray`) in the model's linears,
embeddings and routed experts: the one wrapper every such weight goes through.

`linears(x, ws)` computes x @ w.T for weights that may be QuantArrays, `expert_weights`
turns a store's expert dict {"gate_up@q4_0": uint8 [E, rows, nbytes], ...} (the
`io.weights.quantized` keys: the engine's slots and stores hold plain uint8 arrays, so every copy
and fetch moves the blocks as bytes) into {"gate_up": QuantArray, ...}, and `experts`
runs them.

On the CPU backend the blocks go to the CPU kernels (`moejax.kernels.cpu_quant`):

  cpu_quant.quant_linears(x_NxD, ws_OxD, xla_fn) -> tuple of [N, O], or None
  cpu_quant.quant_expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_fn) -> [N, D], or None

(w: {"gate_up": QuantArray [E, 2I, D], "down": QuantArray [E, D, I]}, or from a GGUF
file "gate" and "up" [E, I, D] apart; None: the kernel does not take these formats or
shapes).  Everywhere else (a GPU, MOEJAX_CPU_KERNEL=0, a format
the kernel lacks) `xla_fn` runs: the weights dequantized in the program (`qarray.dequantize`:
for an expert, only the selected experts' rows) and XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.ggml import qarray
from moejax.ggml.qarray import QuantArray
from moejax.kernels import cpu_matmul
from moejax.kernels import cpu_quant

is_quant = qarray.is_quant


def xla_linears(x_NxD, ws_OxD) -> tuple:
  """x @ w.T each, a QuantArray dequantized (as x's dtype) in the program."""
  return tuple(jnp.einsum("nd,od->no", x_NxD, qarray.values(w, x_NxD.dtype)) for w in ws_OxD)


def linears(x_NxD, ws_OxD) -> tuple:
  """(x @ w.T for w in ws_OxD) where any w may be a QuantArray (`cpu_matmul.linears` when
  none is)."""
  ws_OxD = tuple(ws_OxD)
  if not any(is_quant(w) for w in ws_OxD):
    return cpu_matmul.linears(x_NxD, ws_OxD)
  out = cpu_quant.quant_linears(x_NxD, ws_OxD, xla_linears)
  return tuple(out) if out is not None else xla_linears(x_NxD, ws_OxD)


def embed(table_VxD, tokens_BxT, dtype):
  """Rows `tokens` of an embedding table held as blocks: the rows' blocks gathered, then
  dequantized (never the whole table)."""
  return qarray.dequantize(table_VxD[tokens_BxT], dtype)


def quantized_keys(w: dict) -> bool:
  """Whether an expert dict has the quantized store's keys ('<kind>@<qtype>')."""
  return isinstance(w, dict) and any("@" in k for k in w)


def expert_weights(w: dict, dtype) -> dict:
  """{"<kind>@<qtype>": uint8 blocks [E, ...]} -> {"<kind>": QuantArray(dtype)}; a dict of
  QuantArrays or arrays is returned as it is."""
  if not quantized_keys(w):
    return w
  out = {}
  for key, blocks in w.items():
    kind, _, q = key.partition("@")
    out[kind] = QuantArray(blocks, q, dtype=dtype)
  return out


def take(w, e):
  """Expert e (a traced scalar) of a stacked [E, ...] weight: a dynamic index of the
  blocks then their dequantization for a QuantArray (one expert, not the table)."""
  if is_quant(w):
    return qarray.dequantize(jax.tree.map(
        lambda b: jax.lax.dynamic_index_in_dim(b, e, keepdims=False), w))
  return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def gather(w, ids):
  """w[ids] (experts along the leading axis), dequantized for a QuantArray."""
  return qarray.dequantize(w[ids]) if is_quant(w) else w[ids]


def take_gate_up(w: dict, e):
  """Expert e's [2I, D] gate and up rows: "gate_up", or a GGUF's "gate" and "up" apart."""
  if "gate_up" in w:
    return take(w["gate_up"], e)
  return jnp.concatenate([take(w["gate"], e), take(w["up"], e)], axis=0)


def gather_gate_up(w: dict, ids):
  """[..., 2I, D] gate and up rows of experts `ids` (`take_gate_up` for many)."""
  if "gate_up" in w:
    return gather(w["gate_up"], ids)
  return jnp.concatenate([gather(w["gate"], ids), gather(w["up"], ids)], axis=-2)


def experts(x_NxD, ids_NxK, gates_NxK, w: dict, xla_fn):
  """The routed experts of QuantArray weights: the CPU kernel where it takes them, else
  `xla_fn(x, ids, gates, w)` (which dequantizes through `take` and `gather`)."""
  out = cpu_quant.quant_expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_fn)
  return out if out is not None else xla_fn(x_NxD, ids_NxK, gates_NxK, w)
