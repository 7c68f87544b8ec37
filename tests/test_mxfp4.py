"""gpt_oss's MXFP4 codec (moejax.model.families.mxfp4): hand-built and random bytes against
a reference written from the OCP Microscaling spec, and the quantise/dequantise round trip."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.families import mxfp4


# ------------------------------------------------------------------ MXFP4 codec
def _e2m1_reference(code: int) -> float:
  """E2M1 decoded from its bit fields (sign | 2 exponent bits | 1 mantissa bit)."""
  sign = -1.0 if code & 0b1000 else 1.0
  exp, man = (code >> 1) & 0b11, code & 1
  mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2.0)
  return sign * mag


def reference_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """Element-by-element MXFP4 decode with Python loops (independent of moejax)."""
  *lead, g, nb = blocks.shape
  out = np.zeros(tuple(lead) + (g * 2 * nb,), np.float64)
  for idx in np.ndindex(*lead, g):
    scale = 2.0 ** (int(scales[idx]) - 127)
    for j in range(nb):
      byte = int(blocks[idx + (j,)])
      col = idx[-1] * 2 * nb + 2 * j
      out[idx[:-1] + (col,)] = _e2m1_reference(byte & 0xF) * scale
      out[idx[:-1] + (col + 1,)] = _e2m1_reference(byte >> 4) * scale
  return out


def test_mxfp4_dequantize_hand_built_tensor():
  # Two rows, one block each.  Row 0, scale 128 (x2): byte 0x21 -> low 1 (0.5), high 2 (1.0);
  # byte 0xF9 -> low 9 (-0.5), high 15 (-6.0).  Row 1, scale 125 (x1/4): byte 0x7E -> -4, 6.
  blocks = np.zeros((2, 1, 16), np.uint8)
  blocks[0, 0, 0], blocks[0, 0, 1] = 0x21, 0xF9
  blocks[1, 0, 15] = 0x7E
  scales = np.array([[128], [125]], np.uint8)
  expected = np.zeros((2, 32), np.float32)
  expected[0, :4] = [1.0, 2.0, -1.0, -12.0]
  expected[1, 30:] = [-1.0, 1.5]
  np.testing.assert_array_equal(reference_dequantize(blocks, scales), expected)
  np.testing.assert_array_equal(mxfp4.dequantize_np(blocks, scales), expected)
  np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(jnp.asarray(blocks),
                                                            jnp.asarray(scales))), expected)


def test_mxfp4_dequantize_matches_reference_on_random_bytes():
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 2, 2, 16), dtype=np.uint8)       # [E, R, G, 16]
  scales = rng.integers(118, 136, (3, 2, 2), dtype=np.uint8)
  ref = reference_dequantize(blocks, scales)
  chex.assert_shape(ref, (3, 2, 64))
  np.testing.assert_array_equal(mxfp4.dequantize_np(blocks, scales), ref)
  got = jax.jit(mxfp4.dequantize)(jnp.asarray(blocks), jnp.asarray(scales))
  np.testing.assert_array_equal(np.asarray(got), ref)
  bf = mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.bfloat16)
  chex.assert_type(bf, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(bf, np.float32), ref)   # FP4 * 2^k is exact in bf16
  with pytest.raises(mxfp4.MXFP4Error, match="scales shape"):
    mxfp4.dequantize_np(blocks, scales[..., :1])


def test_mxfp4_quantize_round_trip():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((4, 6, 64)).astype(np.float32) * np.float32(0.03)
  w[0, 0, :32] = 0.0                                                  # an all-zero block
  blocks, scales = mxfp4.quantize(w)
  chex.assert_shape(blocks, (4, 6, 2, 16))
  chex.assert_shape(scales, (4, 6, 2))
  deq = reference_dequantize(blocks, scales)
  # error <= half the largest FP4 step (2) times the block's scale; largest magnitude kept
  scale = np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
  err = np.abs(deq - w).reshape(4, 6, 2, 32)
  assert (err <= scale + 1e-12).all()
  amax = np.abs(w.reshape(4, 6, 2, 32)).max(-1)
  assert (np.abs(deq.reshape(4, 6, 2, 32)).max(-1) >= 0.5 * amax).all()
  np.testing.assert_array_equal(deq[0, 0, :32], 0.0)
  # representable values are fixed points
  b2, s2 = mxfp4.quantize(deq.astype(np.float32))
  np.testing.assert_array_equal(reference_dequantize(b2, s2), deq)
