"""Low-precision expert copies (moejax.io.quant): error bounds, bytes, the disk cache."""

import os

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax.io import quant
from moejax.io.store import ExpertStore

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")


def deq(q, s, bits):
  return np.asarray(quant.dequantize(q, s, bits))


def test_int8_by_hand_scale_is_max_over_127_and_error_at_most_half_a_step():
  # max |w| = 127: s = 1 exactly; -63.5 rounds half to even (-64), 0.4 to 0
  w = np.asarray([[127.0, -63.5, 0.4, 2.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
  q, s = quant.quantize(w, 8)
  chex.assert_shape(s, (2, 1))
  np.testing.assert_array_equal(q, [[127, -64, 0, 2], [0, 0, 0, 0]])
  np.testing.assert_array_equal(s.astype(np.float32), [[1.0], [1.0]])    # a zero row: s = 1
  np.testing.assert_array_equal(deq(q, s, 8), [[127, -64, 0, 2], [0, 0, 0, 0]])


def test_int4_by_hand_groups_pack_two_codes_a_byte():
  # group 32: the first group is exact at s = 1 (max 7: the plain rule); in the second,
  # s = 14 / 8 gives -14 code -8 exactly and 5 code 3 (5.25: error 0.25), against
  # s = 14 / 7 = 2 (the plain rule: 5 -> 2.5 -> 2 -> 4, error 1)
  w = np.zeros((1, 64), np.float32)
  w[0, 0], w[0, 1], w[0, 2] = 7.0, -4.0, 1.0          # codes 7, -4, 1
  w[0, 32], w[0, 33] = -14.0, 5.0                      # codes -8, 3
  q, s = quant.quantize(w, 4, 32)
  chex.assert_shape(q, (1, 32))
  chex.assert_type(q, np.uint8)
  np.testing.assert_array_equal(s.astype(np.float32), [[1.0, 1.75]])
  assert q[0, 0] == (7 + 8) | ((-4 + 8) << 4)          # even column in the low nibble
  assert q[0, 16] == (-8 + 8) | ((3 + 8) << 4)         # code -8 is nibble 0
  want = np.zeros((1, 64), np.float32)
  want[0, :3] = [7, -4, 1]
  want[0, 32:34] = [-14, 5.25]
  np.testing.assert_array_equal(deq(q, s, 4), want)


def test_int8_error_is_at_most_half_a_step_of_a_scale_rounded_up():
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((3, 16, 128)) * rng.uniform(0.01, 3, (3, 16, 1))).astype(np.float32)
  w[0, 0] = 0.0
  q, s = quant.quantize(w, 8)
  sf = s.astype(np.float32)
  # the scale is the smallest bfloat16 >= max|w| / 127 (so no code is clipped)
  exact = np.max(np.abs(w), -1, keepdims=True) / 127
  assert np.all(sf[exact > 0] >= exact[exact > 0])
  below = (sf.astype(ml_dtypes.bfloat16).view(np.uint16) - 1).view(ml_dtypes.bfloat16)
  assert np.all(below.astype(np.float32)[exact > 0] < exact[exact > 0])
  err = np.abs(deq(q, s, 8) - w)
  assert np.all(err <= sf / 2 * (1 + 1e-6))
  assert np.max(err / (sf / 2)) > 0.9    # and tight: half a step is reached


@pytest.mark.parametrize("group", [32, 64])
def test_int4_scale_search_never_loses_to_the_plain_rule_and_error_is_within_a_step(group):
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((3, 16, 128)) * rng.uniform(0.01, 3, (3, 16, 1))).astype(np.float32)
  w[0, 0] = 0.0
  q, s = quant.quantize(w, 4, group)
  sf = s.astype(np.float32)
  wg = w.reshape(3, 16, 128 // group, group)
  err = deq(q, s, 4).reshape(wg.shape) - wg
  assert np.all(np.abs(err) <= sf[..., None] * (1 + 1e-6))      # clipped at 7: one step
  # the plain rule: max|w| / 7 rounded up to a bfloat16, codes in [-7, 7]
  s0 = np.max(np.abs(wg), -1) / 7
  s0 = np.where(s0 > 0, s0, 1.0).astype(ml_dtypes.bfloat16)
  s0 = np.where(s0.astype(np.float32) < np.where(s0 > 0, np.max(np.abs(wg), -1) / 7, 1.0),
                (s0.view(np.uint16) + 1).view(ml_dtypes.bfloat16), s0).astype(np.float32)
  err0 = np.rint(wg / s0[..., None]) * s0[..., None] - wg
  sse, sse0 = np.sum(err ** 2, -1), np.sum(err0 ** 2, -1)
  assert np.all(sse <= sse0 * (1 + 1e-6))                       # per group, never worse
  assert np.sum(sse) < 0.9 * np.sum(sse0)                       # and better overall
  assert np.any(sf != s0)
  np.testing.assert_array_equal(deq(q, s, 4)[0, 0], 0.0)        # a zero row stays zero


def test_bytes_of_the_demo_expert_shapes():
  shapes = {"gate_up": (64, 128), "down": (128, 32)}
  assert quant.bf16_nbytes(shapes) == 2 * (64 * 128 + 128 * 32) == 24576
  # int8: a byte a weight + a bf16 scale a row; int4 g32: half a byte + a scale per 32
  assert quant.low_nbytes(shapes, 8) == 64 * (128 + 2) + 128 * (32 + 2) == 12672
  assert quant.low_nbytes(shapes, 4, 32) == 64 * (64 + 8) + 128 * (16 + 2) == 6912
  rng = np.random.default_rng(1)
  store = ExpertStore.from_stacked([{k: rng.standard_normal((4,) + v).astype(np.float32)
                                     for k, v in shapes.items()}])
  for bits in (8, 4):
    low = quant.build(store, bits, 32)
    per = sum(a[0].nbytes for a in low.stacked(0).values())
    assert per == low.expert_nbytes() == quant.low_nbytes(shapes, bits, 32)


def test_bad_formats_name_the_flag():
  with pytest.raises(quant.QuantError, match="--low_bits"):
    quant.check_format(2, 32)
  with pytest.raises(quant.QuantError, match="--low_group"):
    quant.check_format(4, 16)
  with pytest.raises(quant.QuantError, match="'down'"):
    quant.check_format(4, 64, {"down": (128, 32)})


def test_disk_cache_is_reused_and_a_corrupt_file_rebuilt(tmp_path):
  if not os.path.exists(os.path.join(DEMO, "config.json")):
    pytest.skip("no demo checkpoint")
  from moejax.io.loader import load_model
  _, _, store = load_model(DEMO, dtype=jnp.float32)
  first = quant.load_or_build(store, 4, 32, model_dir=DEMO, cache_dir=str(tmp_path))
  assert not first.reused and first.path.startswith(str(tmp_path))
  second = quant.load_or_build(store, 4, 32, model_dir=DEMO, cache_dir=str(tmp_path))
  assert second.reused and second.path == first.path
  chex.assert_trees_all_equal(first.layers, second.layers, strict=True)
  # another precision is another key; the int4 file is untouched
  assert quant.load_or_build(store, 8, model_dir=DEMO, cache_dir=str(tmp_path)).path != first.path
  with open(first.path, "r+b") as f:              # corrupt the payload: detected, rebuilt
    f.seek(os.path.getsize(first.path) // 2)
    f.write(b"\xff" * 64)
  third = quant.load_or_build(store, 4, 32, model_dir=DEMO, cache_dir=str(tmp_path))
  assert not third.reused
  chex.assert_trees_all_equal(first.layers, third.layers, strict=True)
  assert quant.load_or_build(store, 4, 32, model_dir=DEMO, cache_dir=str(tmp_path)).reused
