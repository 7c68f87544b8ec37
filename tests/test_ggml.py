"""ggml's block formats (moejax.ggml): bytes identical to gguf-py for Q8_0 / Q4_0, K-quants
read back by gguf-py's dequantizer within error bounds, JAX's dequantize equal to numpy's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.ggml import blocks
from moejax.ggml import qarray
from moejax.ggml import types

try:
  import gguf
  from gguf import GGMLQuantizationType as T
except ImportError:       # the `gguf` extra
  gguf = None

needs_gguf = pytest.mark.skipif(gguf is None, reason="gguf (pip install moejax[gguf]) is not "
                                "installed: no reference to compare the blocks with")
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}


def _rows(o=48, c=512, seed=0):
  rng = np.random.default_rng(seed)
  w = (rng.standard_normal((o, c)) * 0.05).astype(np.float32)
  w[1] = 0.0                                  # an all-zero row
  w[2, :40] = 0.0                             # a zero block in a row
  w[3] *= 1e-3                                # a small row
  w[4, 7] = 1.5                               # an outlier
  w[5] = np.abs(w[5])                         # one sign only (a min of 0 for Q4_K)
  return w


@needs_gguf
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_blocks_bit_identical_to_gguf(qtype):
  w = _rows()
  ref = gguf.quants.quantize(w, getattr(T, GGUF_TYPES[qtype]))
  got = blocks.quantize(w, qtype)
  assert got.dtype == np.uint8 and got.shape == ref.shape
  np.testing.assert_array_equal(got, ref)
  bf = w.astype(jnp.bfloat16)                 # a bf16 checkpoint's rows, as the repack reads
  np.testing.assert_array_equal(blocks.quantize(bf, qtype), gguf.quants.quantize(
      bf.astype(np.float32), getattr(T, GGUF_TYPES[qtype])))


# relative RMS error bounds on Gaussian rows (measured: q8_0 0.0054, q4_0 0.087,
# q4_k 0.071, q6_k 0.018)
BOUNDS = {"q8_0": 0.007, "q4_0": 0.1, "q4_k": 0.08, "q6_k": 0.022}


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_round_trip_error_and_gguf_dequantize(qtype):
  w = _rows()
  b = blocks.quantize(w, qtype)
  f = types.get(qtype)
  assert b.shape == (w.shape[0], w.shape[1] // f.block * f.type_size)
  back = blocks.dequantize(b, qtype)
  np.testing.assert_array_equal(back[1], 0.0)
  normal = np.r_[0, 6:w.shape[0]]
  rel = np.sqrt(np.mean((back[normal] - w[normal]) ** 2) / np.mean(w[normal] ** 2))
  assert rel < BOUNDS[qtype]
  # each value within its block's step (per-block error bound)
  blk = w.reshape(-1, f.block)
  err = np.abs(back.reshape(-1, f.block) - blk).max(axis=1)
  amax = np.abs(blk).max(axis=1)
  # (q8_0: half a step, and the f16 scale's rounding, up to 127 * 2^-11 of a step; a tiny
  # block's scale is an f16 subnormal, steps of 2^-24: up to 128 * 2^-24 more)
  assert np.all(err <= amax * {"q8_0": 0.57 / 127, "q4_0": 1 / 7, "q4_k": 0.25,
                               "q6_k": 0.08}[qtype] + 128 * 2.0 ** -24)
  if gguf is not None:
    np.testing.assert_array_equal(back, gguf.quants.dequantize(b, getattr(T, GGUF_TYPES[qtype])))


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_jax_dequantize_equals_numpy(qtype):
  w = np.random.default_rng(1).standard_normal((2, 8, 512)).astype(np.float32) * 0.1
  qa = qarray.quantize(w, qtype, dtype=jnp.float32)
  assert qa.shape == w.shape and qa.nbytes == qa.blocks.size
  ref = blocks.dequantize(qa.blocks, qtype)
  np.testing.assert_array_equal(np.asarray(jax.jit(qarray.dequantize)(qa)), ref)
  # a pytree: stacked, sliced and vmapped, the logical shape follows the blocks
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), qa)
  assert stacked.shape == (2,) + w.shape and stacked.qtype == qtype
  one = jax.tree.map(lambda a: a[1], stacked)[0]
  np.testing.assert_array_equal(np.asarray(qarray.dequantize(one)), ref[0])
  rows = jax.vmap(lambda q: qarray.dequantize(q).sum(-1))(qa)
  np.testing.assert_allclose(np.asarray(rows), ref.sum(-1), rtol=1e-5, atol=1e-5)
  assert qarray.dequantize(qa.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_errors_name_the_format_and_row():
  with pytest.raises(types.FormatError, match="q4_k's block of 256.*'blk.0.attn_q.weight'|"
                     "'blk.0.attn_q.weight'.*256"):
    blocks.quantize(np.zeros((4, 96), np.float32), "q4_k", "'blk.0.attn_q.weight'")
  with pytest.raises(types.FormatError, match="unknown block format 'q3_k'"):
    types.get("q3_k")
  with pytest.raises(types.FormatError, match="not whole blocks"):
    qarray.QuantArray(np.zeros((2, 35), np.uint8), "q8_0")
