"""`QuantArray`: a weight held as ggml blocks, standing wherever a weight array stands.

A pytree (registered) whose one leaf is `blocks`, uint8 [..., O, C / block * type_size]
(GGUF's raw block bytes, row-major: `types`), with static `qtype` ("q8_0", "q4_0", "q4_k",
"q6_k") and `dtype` (the dequantized values' dtype).  `shape` is the logical shape
[..., O, C], derived from the blocks, so a QuantArray stays consistent under `tree_map`s
that stack, slice or vmap its leaf (the engine's [L, ...] layer stack, a slot's rows).
`x[i]` indexes the leading (not the last) axes.

`dequantize(qa)` is the JAX dequantizer: pure jnp, so it runs inside a jitted program on any
backend (a GPU, or XLA's CPU ops where no kernel takes the blocks); its values equal
`blocks.dequantize` (numpy, f32) exactly before the cast to `dtype`.  `quantize(w, qtype)`
makes one on the host (`blocks.quantize`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.ggml import blocks as blocks_lib
from moejax.ggml import types


@jax.tree_util.register_pytree_node_class
class QuantArray:
  """blocks uint8 [..., O, nbytes]; static qtype and dtype; logical `shape` [..., O, C]."""

  def __init__(self, blocks, qtype: str, shape=None, dtype=jnp.bfloat16):
    f = types.get(qtype)
    self.blocks, self.qtype, self.dtype = blocks, qtype, jnp.dtype(dtype)
    if getattr(blocks, "dtype", None) is not None and jnp.dtype(blocks.dtype) != jnp.uint8:
      raise types.FormatError(f"QuantArray({qtype}): blocks must be uint8, got "
                              f"{blocks.dtype}")
    if np.shape(blocks)[-1] % f.type_size:
      raise types.FormatError(f"QuantArray({qtype}): rows of {np.shape(blocks)[-1]} bytes "
                              f"are not whole blocks of {f.type_size}")
    if shape is not None and tuple(shape) != self.shape:
      raise types.FormatError(f"QuantArray({qtype}): blocks {tuple(np.shape(blocks))} hold "
                              f"shape {self.shape}, not {tuple(shape)}")

  def tree_flatten(self):
    return (self.blocks,), (self.qtype, self.dtype.name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    out = object.__new__(cls)         # no checks: leaves may be tracers, specs or None
    out.blocks, (out.qtype, dt) = children[0], aux
    out.dtype = jnp.dtype(dt)
    return out

  @property
  def format(self) -> types.Format:
    return types.get(self.qtype)

  @property
  def shape(self) -> tuple:
    s = tuple(np.shape(self.blocks))
    return s[:-1] + (self.format.values(s[-1]),)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def nbytes(self) -> int:
    """Bytes of the blocks (what a store holds and a fetch moves)."""
    return int(np.prod(np.shape(self.blocks)))

  def __getitem__(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) >= self.ndim or any(i is Ellipsis for i in idx):
      raise IndexError(f"QuantArray({self.qtype}) indexes its leading axes only, got {idx}")
    return QuantArray(self.blocks[idx], self.qtype, dtype=self.dtype)

  def astype(self, dtype) -> "QuantArray":
    """The same blocks, dequantized to `dtype`."""
    return QuantArray(self.blocks, self.qtype, dtype=dtype)

  def __repr__(self):
    return f"QuantArray({self.qtype}, shape={self.shape}, dtype={self.dtype.name})"


def is_quant(x) -> bool:
  return isinstance(x, QuantArray)


def quantize(w, qtype: str, dtype=None, what: str = "the weight") -> QuantArray:
  """w [..., C] (host, any float) as a QuantArray of numpy blocks; dtype: w's unless given."""
  dt = dtype if dtype is not None else (w.dtype if jnp.issubdtype(w.dtype, jnp.floating)
                                        else jnp.float32)
  return QuantArray(blocks_lib.quantize(w, qtype, what), qtype, dtype=dt)


def _f16(b_Nx2):
  """Two bytes (little-endian) per row -> f32 of the f16 they hold."""
  u16 = b_Nx2[..., 0].astype(jnp.uint16) | (b_Nx2[..., 1].astype(jnp.uint16) << 8)
  return jax.lax.bitcast_convert_type(u16, jnp.float16).astype(jnp.float32)


def _nibbles(q):
  """[..., n] bytes -> [..., 2, n]: low nibbles, then high."""
  return jnp.stack([q & 0xF, q >> 4], axis=-2)


def _q8_0(b):
  return _f16(b[..., 0:2])[..., None] * jax.lax.bitcast_convert_type(
      b[..., 2:], jnp.int8).astype(jnp.float32)


def _q4_0(b):
  codes = _nibbles(b[..., 2:]).reshape(b.shape[:-1] + (32,)).astype(jnp.float32) - 8
  return _f16(b[..., 0:2])[..., None] * codes


def _q4_k(b):
  lead = b.shape[:-1]
  d, dmin, s = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16]
  sc = jnp.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
  m = jnp.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
  codes = _nibbles(b[..., 16:].reshape(lead + (4, 32))).reshape(lead + (8, 32))
  y = ((d[..., None] * sc.astype(jnp.float32))[..., None] * codes.astype(jnp.float32)
       - (dmin[..., None] * m.astype(jnp.float32))[..., None])
  return y.reshape(lead + (256,))


def _q6_k(b):
  lead = b.shape[:-1]
  ql = _nibbles(b[..., :128].reshape(lead + (2, 64)))            # [..., 2, 2, 64]
  qh = b[..., 128:192].reshape(lead + (2, 1, 32))
  hi = jnp.concatenate([(qh >> k) & 3 for k in (0, 2, 4, 6)], axis=-2)   # [..., 2, 4, 32]
  codes = (ql.reshape(lead + (2, 4, 32)) | (hi << 4)).astype(jnp.float32) - 32
  sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
  d = _f16(b[..., 208:210])
  y = (d[..., None] * sc)[..., None] * codes.reshape(lead + (16, 16))
  return y.reshape(lead + (256,))


_BLOCK_FNS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q6_k": _q6_k}


def dequantize(qa: QuantArray, dtype=None) -> jax.Array:
  """The values [..., O, C] of `qa` as `dtype` (default qa.dtype), in jnp."""
  f = qa.format
  b = jnp.asarray(qa.blocks)
  nb = b.shape[-1] // f.type_size
  y = _BLOCK_FNS[qa.qtype](b.reshape(b.shape[:-1] + (nb, f.type_size)))
  return y.reshape(b.shape[:-1] + (nb * f.block,)).astype(dtype or qa.dtype)


def values(w, dtype=None):
  """A weight as an array: `dequantize` for a QuantArray, else w (cast when dtype)."""
  if is_quant(w):
    return dequantize(w, dtype)
  return w if dtype is None else jnp.asarray(w).astype(dtype)
