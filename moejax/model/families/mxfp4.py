"""MXFP4 (OCP microscaling FP4) as GPT-OSS checkpoints store their routed experts.

A weight matrix [..., R, C] is cut along C into blocks of 32 values.  Each block
shares one uint8 exponent ``scale`` (value = fp4 * 2^(scale - 127)); the 32 FP4
(E2M1) codes are packed two per byte, the *low* nibble holding the even
element.  Hub tensors: ``*_blocks`` uint8 [..., R, C/32, 16] and ``*_scales``
uint8 [..., R, C/32].

`dequantize` is the jnp version that runs inside the jitted expert computation
(so the host->device copy moves 4.25 bits per weight); `dequantize_np` is the
numpy version used when a checkpoint is dequantised on load; `quantize` writes
the hub layout (tests, conversion).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moejax.model.families.configs.gpt_oss import MXFP4_BLOCK as BLOCK  # values per exponent
from moejax.model.families.configs.gpt_oss import MXFP4_BYTES_PER_BLOCK as BYTES_PER_BLOCK
SCALE_BIAS = 127

# E2M1 code -> value (code bit 3 is the sign), as in the OCP MX spec.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


class MXFP4Error(ValueError):
  """Blocks and scales that do not describe one MXFP4 tensor."""


def _check_shapes(blocks_shape, scales_shape):
  if len(blocks_shape) < 2 or blocks_shape[-1] != BYTES_PER_BLOCK:
    raise MXFP4Error(f"MXFP4 blocks must have a last axis of {BYTES_PER_BLOCK} bytes, "
                     f"got shape {tuple(blocks_shape)}")
  if tuple(blocks_shape[:-1]) != tuple(scales_shape):
    raise MXFP4Error(f"MXFP4 scales shape {tuple(scales_shape)} does not match blocks shape "
                     f"{tuple(blocks_shape)} (expected {tuple(blocks_shape[:-1])})")


def dequantized_shape(blocks_shape) -> tuple[int, ...]:
  """[..., R, G, 16] -> [..., R, G * 32]."""
  return tuple(blocks_shape[:-2]) + (blocks_shape[-2] * BLOCK,)


def dequantize(blocks, scales, dtype=jnp.float32):
  """jnp: uint8 blocks [..., R, G, 16] and scales [..., R, G] -> [..., R, G*32] in `dtype`."""
  _check_shapes(blocks.shape, scales.shape)
  lut = jnp.asarray(FP4_VALUES)
  b = blocks.astype(jnp.int32)
  lo, hi = lut[b & 0x0F], lut[b >> 4]                           # [..., G, 16] each
  v = jnp.stack([lo, hi], axis=-1).reshape(blocks.shape[:-1] + (BLOCK,))  # even = low nibble
  e = scales.astype(jnp.int32)[..., None] - SCALE_BIAS
  v = jnp.ldexp(v, e)
  return v.reshape(dequantized_shape(blocks.shape)).astype(dtype)


def dequantize_np(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
  """numpy twin of `dequantize` (host side, for dequantise-on-load)."""
  _check_shapes(blocks.shape, scales.shape)
  b = np.asarray(blocks, np.uint8)
  v = np.stack([FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]], axis=-1)
  v = v.reshape(b.shape[:-1] + (BLOCK,))
  v = np.ldexp(v, np.asarray(scales, np.int32)[..., None] - SCALE_BIAS)
  return v.reshape(dequantized_shape(b.shape)).astype(dtype)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Round w [..., R, C] (C a multiple of 32) to MXFP4: (blocks uint8, scales uint8).

  The shared exponent is the smallest one that keeps the block's largest magnitude
  within the FP4 range (<= 6); values are rounded to the nearest FP4 code.
  """
  w = np.asarray(w, np.float32)
  if w.ndim < 1 or w.shape[-1] % BLOCK:
    raise MXFP4Error(f"MXFP4 needs the last axis to be a multiple of {BLOCK}, got {w.shape}")
  g = w.reshape(w.shape[:-1] + (w.shape[-1] // BLOCK, BLOCK))
  amax = np.abs(g).max(axis=-1)
  with np.errstate(divide="ignore"):
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 6.0)), 0.0)
  e = np.clip(e, -SCALE_BIAS, 127).astype(np.int32)
  v = np.ldexp(g, -e[..., None])
  codes = np.abs(v[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)  # -0 never wins
  blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  return blocks, (e + SCALE_BIAS).astype(np.uint8)
