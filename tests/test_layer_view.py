"""Kernels reading one layer of stacked [L, ...] operands in place (`layer_view`, the
`_at` kernel variants): inside a scan over layers each gives the bits of the same kernel
on the sliced layer, the program calls the `_at` targets, and carried stacks are updated
in place at (layer, ...)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import cpu_attention, cpu_host, cpu_kernel, cpu_matmul, layer_view
from moejax.model import experts as experts_lib
from moejax.model import layers

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason="no C++ compiler: the kernel is not built")
L = 3


def _scan(fn, n: int, *stacks):
  """[fn(layer i of each stack, sliced or as a view) for i < n] as one scan, twice: the
  views (the `_at` kernels) and plain slices (the kernels on a copy of the layer)."""
  def run(view, *stacks):
    def body(c, i):
      with layer_view.tracing():
        get = layer_view.at if view else (lambda s, i: s[i])
        return c, fn(*[get(s, i) for s in stacks])
    return jax.lax.scan(body, 0, jnp.arange(n, dtype=jnp.int32))[1]
  return jax.jit(lambda *s: run(True, *s)), jax.jit(lambda *s: run(False, *s))


def _check(fn, target, *stacks):
  viewed, sliced = _scan(fn, L, *stacks)
  assert target in viewed.lower(*stacks).as_text()
  assert target not in sliced.lower(*stacks).as_text()
  got, want = viewed(*stacks), sliced(*stacks)
  chex.assert_trees_all_equal(got, want)     # the same kernel on the same bytes: same bits
  return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linears_at(dtype):
  rng = np.random.default_rng(0)
  ws = [jnp.asarray(rng.normal(size=(L, o, 96)), dtype) for o in (4096, 40, 64)]
  x = jnp.asarray(rng.normal(size=(2, 96)), dtype)
  got = _check(lambda *w: cpu_matmul.linears(x, w), cpu_kernel.LINEAR_AT_TARGET, *ws)
  want = jnp.einsum("nd,lod->lno", x.astype(jnp.float32), ws[0].astype(jnp.float32))
  chex.assert_trees_all_close(got[0].astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint16])
def test_expert_ffn_at(dtype):
  rng = np.random.default_rng(1)
  e, d, inter = 5, 40, 24
  mk = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.bfloat16 if dtype == jnp.uint16
                              else dtype)
  gu, dn = mk(L, e, 2 * inter, d), mk(L, e, d, inter)
  if dtype == jnp.uint16:    # the engine's slot buffers / program store: bf16 bits
    gu, dn = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (gu, dn))
  x = jnp.asarray(rng.normal(size=(1, d)), jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
  ids = jnp.asarray([[4, 0, 2]], jnp.int32)
  gates = jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32)
  fn = lambda gu, dn: experts_lib.apply_experts(x, ids, gates, {"gate_up": gu, "down": dn})
  _check(fn, cpu_kernel.TARGET_AT, gu, dn)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint16])
def test_host_experts_at(dtype):
  rng = np.random.default_rng(2)
  e, d, inter = 4, 64, 16
  mk = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
  gu, dn = mk(L, e, 2 * inter, d), mk(L, e, d, inter)
  if dtype == jnp.uint16:
    gu, dn = (jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16), jnp.uint16) for a in (gu, dn))
  x = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
  ids, gates = jnp.asarray([3, 1], jnp.int32), jnp.asarray([0.7, 0.0], jnp.float32)
  fn = lambda gu, dn: cpu_host.host_experts(x, ids, gates, {"gate_up": gu, "down": dn},
                                            experts_lib.xla_experts)
  _check(fn, cpu_kernel.HOST_EXPERTS_AT_TARGET, gu, dn)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_at_and_cache_update(dtype):
  rng = np.random.default_rng(3)
  s_len, g, h, kd = 12, 2, 4, 16
  k = jnp.asarray(rng.normal(size=(L, 1, s_len, g, kd)), dtype)
  v = jnp.asarray(rng.normal(size=(L, 1, s_len, g, kd)), dtype)
  q = jnp.asarray(rng.normal(size=(1, 1, h, kd)), dtype)
  new_k = jnp.asarray(rng.normal(size=(1, 1, g, kd)), dtype)
  pos = jnp.asarray([[5]], jnp.int32)

  def fn(kc, vc):   # write the new key at position 5, then attend over the written cache
    kv, _, cache = layers.read_cache({"k": kc, "v": vc}, {"k": new_k, "v": new_k}, pos, 5)
    o = cpu_attention.decode_attention(q, kv["k"], kv["v"], pos, kd ** -0.5, None, None,
                                       lambda: jnp.zeros(q.shape[:2] + (h * kd,), dtype))
    return o
  _check(fn, cpu_kernel.ATTENTION_AT_TARGET, k, v)


def test_update_writes_the_stack_in_place_at_the_layer():
  stack = jnp.zeros((L, 4, 3), jnp.bfloat16)

  def body(st, i):
    with layer_view.tracing():
      view = layer_view.at(st, i)
      new = layer_view.update(view, jnp.full((1, 3), i + 1, jnp.bfloat16), (i, 0))
      out = layer_view.stack_at(new, i)
      assert out is not None and layer_view.stack_at(new, i + 0) is None   # another index
      return out, layer_view.rows(new, i, 1)
  st, rows = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(L)))(stack)
  want = np.zeros((L, 4, 3), np.float32)
  for i in range(L):
    want[i, i] = i + 1
  chex.assert_trees_all_equal(np.asarray(st, np.float32), want)
  chex.assert_trees_all_equal(np.asarray(rows, np.float32)[:, 0], want[np.arange(L), np.arange(L)])


def test_outside_tracing_a_view_is_a_plain_slice():
  stack = jnp.arange(6.0).reshape(2, 3)
  x = layer_view.at(stack, jnp.int32(1))
  assert layer_view.of(x) is None
  chex.assert_trees_all_equal(x, stack[1])
