"""The CPU decode-attention kernel: a hand-checked case, agreement with XLA's attention
(f32 and bf16, grouped heads, sliding window, sinks, several queries, under vmap), and
the decode path using it."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import cpu_attention
from moejax.kernels import cpu_kernel
from moejax.model import layers

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason="no C++ compiler: the kernel is not built")


def _xla(q, k, v, pos, scale, window, sinks):
  kp = layers.cache_positions(v, q.shape[0])
  return layers.gqa_attention(q, k, v, pos, kp, scale, window, sinks)


def _kernel(q, k, v, pos, scale, window=None, sinks=None):
  fn = lambda q, k, v, p: cpu_attention.decode_attention(
      q, k, v, p, scale, window, sinks, lambda: _xla(q, k, v, p, scale, window, sinks))
  return jax.jit(fn)(q, k, v, pos)


def test_hand_checked():
  # one head, K=1, cache of 4 positions; the query at position 2 sees keys 0..2:
  # scores q*k = [0, 1, 2] (scale 1), p = softmax, o = sum p_j v_j; position 3 unseen
  q = jnp.ones((1, 1, 1, 1))
  k = jnp.array([0.0, 1.0, 2.0, 50.0]).reshape(1, 4, 1, 1)
  v = jnp.array([1.0, 10.0, 100.0, 1e6]).reshape(1, 4, 1, 1)
  pos = jnp.array([[2]], jnp.int32)
  e = np.exp([0.0, 1.0, 2.0])
  want = float(np.dot(e / e.sum(), [1.0, 10.0, 100.0]))
  chex.assert_trees_all_close(float(_kernel(q, k, v, pos, 1.0)[0, 0, 0]), want, rtol=1e-6)
  # a window of 2 keeps keys 1..2; a sink logit of 0 joins the denominator
  e2 = np.exp([1.0, 2.0])
  chex.assert_trees_all_close(float(_kernel(q, k, v, pos, 1.0, window=2)[0, 0, 0]),
                              float(np.dot(e2 / e2.sum(), [10.0, 100.0])), rtol=1e-6)
  sinks = jnp.zeros((1,), jnp.float32)
  chex.assert_trees_all_close(float(_kernel(q, k, v, pos, 1.0, sinks=sinks)[0, 0, 0]),
                              float(np.dot(e / (e.sum() + 1.0), [1.0, 10.0, 100.0])), rtol=1e-6)


CASES = [  # B, T, H, G, K, S, window, sinks
    (1, 1, 8, 4, 64, 40, None, False),     # decode, grouped heads
    (2, 3, 4, 2, 16, 33, 5, True),         # several queries, window, sinks
    (1, 1, 4, 4, 20, 17, None, True),      # head dim not a multiple of 8
    (8, 1, 4, 2, 32, 300, None, True),     # a batch's rows over a long cache: on the pool
    (1, 1, 32, 4, 128, 600, None, False),  # Qwen3-30B-A3B's heads: 8 a group, one call
    (2, 2, 24, 2, 20, 70, 9, True),        # 12 a group: 8 heads read together, then 4
]


@pytest.mark.parametrize("b,t,h,g,kd,s,window,sinks", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_xla_attention(b, t, h, g, kd, s, window, sinks, dtype):
  rng = np.random.default_rng(s)
  q = jnp.asarray(rng.standard_normal((b, t, h, kd)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, g, kd)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, g, kd)), dtype)
  pos = jnp.asarray(rng.integers(0, s, (b, t)), jnp.int32)
  sk = jnp.asarray(rng.standard_normal(h), jnp.float32) if sinks else None
  got = _kernel(q, k, v, pos, kd ** -0.5, window, sk)
  chex.assert_type(got, q.dtype)
  chex.assert_shape(got, (b, t, h * kd))
  want = _xla(q, k, v, pos, kd ** -0.5, window, sk)
  tol = 1e-6 if dtype == jnp.float32 else 2e-2     # bf16: XLA rounds its scores to bf16
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  chex.assert_trees_all_close(f32(got), f32(want), atol=tol * 4, rtol=0)
  # under vmap (the emulator's streams): each element as alone
  qs, ks, vs = jnp.stack([q, q * 0.5]), jnp.stack([k, k[:, ::-1]]), jnp.stack([v, v * 2])
  fn = lambda q, k, v: cpu_attention.decode_attention(
      q, k, v, pos, kd ** -0.5, window, sk, lambda: _xla(q, k, v, pos, kd ** -0.5, window, sk))
  gv = jax.jit(jax.vmap(fn))(qs, ks, vs)
  for i in range(2):
    chex.assert_trees_all_close(f32(gv[i]), f32(_kernel(qs[i], ks[i], vs[i], pos,
                                                        kd ** -0.5, window, sk)), atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_query_gets_the_same_bits_in_any_call(dtype):
  # heads are read a group at a time and positions 8 at a time: a (row, token)'s output
  # must not depend on the other rows and tokens of the call
  rng = np.random.default_rng(7)
  b, t, h, g, kd, s = 3, 4, 12, 2, 24, 50
  q = jnp.asarray(rng.standard_normal((b, t, h, kd)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, g, kd)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, g, kd)), dtype)
  pos = jnp.asarray(rng.integers(0, s, (b, t)), jnp.int32)
  sk = jnp.asarray(rng.standard_normal(h), jnp.float32)
  whole = np.asarray(_kernel(q, k, v, pos, 0.3, None, sk), np.float32)
  for r in range(b):
    for i in range(t):
      one = _kernel(q[r:r + 1, i:i + 1], k[r:r + 1], v[r:r + 1], pos[r:r + 1, i:i + 1], 0.3,
                    None, sk)
      np.testing.assert_array_equal(np.asarray(one, np.float32)[0, 0], whole[r, i])


def test_decode_uses_the_kernel_prefill_does_not():
  rng = np.random.default_rng(0)
  cache = {"k": jnp.zeros((1, 32, 2, 8)), "v": jnp.zeros((1, 32, 2, 8))}
  q = jnp.asarray(rng.standard_normal((1, 1, 4, 8)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
  pos = jnp.array([[3]], jnp.int32)
  step = lambda q, k, v, c: layers.cached_attention(q, k, v, pos, c, 3)
  assert cpu_kernel.ATTENTION_TARGET in jax.jit(step).lower(q, kv, kv, cache).as_text()
  long_q = jnp.zeros((1, cpu_attention.MAX_QUERIES + 1, 4, 8))
  long_kv = jnp.zeros((1, cpu_attention.MAX_QUERIES + 1, 2, 8))
  hlo = jax.jit(lambda q, k, v, c: layers.cached_attention(
      q, k, v, jnp.zeros((1, q.shape[1]), jnp.int32), c, 0)).lower(long_q, long_kv, long_kv,
                                                                   cache).as_text()
  assert cpu_kernel.ATTENTION_TARGET not in hlo
  with cpu_kernel.enabled(False):    # a new function: jit caches traces per function
    hlo = jax.jit(lambda q, k, v, c: layers.cached_attention(q, k, v, pos, c, 3)).lower(
        q, kv, kv, cache).as_text()
  assert cpu_kernel.ATTENTION_TARGET not in hlo
