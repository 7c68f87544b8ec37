"""numpy quantizers and dequantizers of the block formats (`types`), on the host.

`quantize(w, qtype)`: w [..., C] (any float) -> uint8 [..., C / block * type_size];
`dequantize(blocks, qtype)`: back to f32 [..., C].  Q8_0 and Q4_0 follow ggml's reference
quantizers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`) as gguf-py's
`gguf.quants.quantize` does, so their bytes are identical to it on the same rows
(tests/test_ggml.py); Q4_K and Q6_K are `kquants`.  Rows are quantized a chunk at a time
(`CHUNK_VALUES`), so a large tensor never needs its f32 copy whole.
"""

from __future__ import annotations

import numpy as np

from moejax.ggml import kquants
from moejax.ggml import types

CHUNK_VALUES = 1 << 22          # values quantized at a time (16 MB of f32)


def _round_away(x):
  """Round half away from zero (C's roundf), as ggml and gguf-py."""
  a = np.abs(x)
  f = np.floor(a)
  return np.sign(x) * (f + np.floor(2 * (a - f)))


def _f16_bytes(d_N):
  return d_N.astype(np.float16).view(np.uint8).reshape(-1, 2)


def q8_0_blocks(x_Nx32):
  d = np.abs(x_Nx32).max(axis=1, keepdims=True) / np.float32(127)
  with np.errstate(divide="ignore"):
    inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
  q = _round_away(x_Nx32 * inv).astype(np.int8).view(np.uint8)
  return np.concatenate([_f16_bytes(d), q], axis=1)


def q4_0_blocks(x_Nx32):
  imax = np.abs(x_Nx32).argmax(axis=-1)[:, None]
  d = np.take_along_axis(x_Nx32, imax, axis=-1) / np.float32(-8)
  with np.errstate(divide="ignore"):
    inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
  q = np.trunc(x_Nx32 * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
  packed = q[:, :16] | (q[:, 16:] << np.uint8(4))
  return np.concatenate([_f16_bytes(d), packed], axis=1)


def _f16(b_Nx2):
  return np.ascontiguousarray(b_Nx2).view(np.float16).astype(np.float32)


def q8_0_values(b_Nx34):
  return _f16(b_Nx34[:, :2]) * b_Nx34[:, 2:].view(np.int8).astype(np.float32)


def q4_0_values(b_Nx18):
  q = b_Nx18[:, 2:]
  codes = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32) - 8
  return _f16(b_Nx18[:, :2]) * codes


_QUANT = {"q8_0": q8_0_blocks, "q4_0": q4_0_blocks, "q4_k": kquants.q4_k_blocks,
          "q6_k": kquants.q6_k_blocks}
_DEQUANT = {"q8_0": q8_0_values, "q4_0": q4_0_values, "q4_k": kquants.q4_k_values,
            "q6_k": kquants.q6_k_values}


def quantize(w, qtype: str, what: str = "the weight") -> np.ndarray:
  """w [..., C] -> its blocks, uint8 [..., C / block * type_size] (f32 arithmetic)."""
  f = types.get(qtype)
  w = np.asarray(w)
  types.check_row(qtype, w.shape[-1], what)
  lead, c = w.shape[:-1], w.shape[-1]
  rows = w.reshape(-1, c)
  out = np.empty((rows.shape[0], f.row_bytes(c)), np.uint8)
  step = max(1, CHUNK_VALUES // max(c, 1))
  for r in range(0, rows.shape[0], step):
    x = np.asarray(rows[r:r + step], np.float32).reshape(-1, f.block)
    out[r:r + step] = _QUANT[qtype](x).reshape(-1, f.row_bytes(c))
  return out.reshape(lead + (f.row_bytes(c),))


def dequantize(blocks, qtype: str) -> np.ndarray:
  """uint8 [..., nbytes] blocks -> f32 [..., values]."""
  f = types.get(qtype)
  b = np.asarray(blocks, np.uint8)
  if b.shape[-1] % f.type_size:
    raise types.FormatError(f"{qtype}: rows of {b.shape[-1]} bytes are not whole blocks of "
                            f"{f.type_size}")
  y = _DEQUANT[qtype](b.reshape(-1, f.type_size))
  return y.reshape(b.shape[:-1] + (f.values(b.shape[-1]),))
