"""The host-expert kernel (kernels/cpu_host.cc): the XLA reference expert on odd shapes,
each weight layout (f32, bf16, bf16 as uint16 bits), zero gates skipped, B rows in one
call equal to one call per row, and the engine's HOST call (`sources.host_experts`)
through it."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import cpu_host, cpu_kernel
from moejax.model import experts as experts_lib
from moejax.model.config import ModelConfig
from moejax.offload import sources

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason="no C++ compiler: the kernel is not built")
f32 = lambda a: jnp.asarray(a, jnp.float32)


def _weights(rng, e, d, inter, layout):
  w = {"gate_up": rng.normal(size=(e, 2 * inter, d)) * 0.3,
       "down": rng.normal(size=(e, d, inter)) * 0.3}
  if layout == "f32":
    return {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}
  bf = {k: jnp.asarray(v, jnp.bfloat16) for k, v in w.items()}
  return bf if layout == "bf16" else {k: jax.lax.bitcast_convert_type(v, jnp.uint16)
                                      for k, v in bf.items()}


def _as_f32(w):
  return {k: f32(jax.lax.bitcast_convert_type(v, jnp.bfloat16) if v.dtype == jnp.uint16 else v)
          for k, v in w.items()}


@pytest.mark.parametrize("d, inter, e, k", [(2048, 768, 3, 2),    # the Qwen3-30B-A3B expert
                                            (75, 13, 5, 3),       # tails of every loop
                                            (1, 1, 2, 1), (130, 40, 4, 4)])
@pytest.mark.parametrize("layout, xdt", [("f32", jnp.float32), ("bf16", jnp.bfloat16),
                                         ("bits", jnp.bfloat16), ("bits", jnp.float32)])
def test_matches_the_xla_reference_expert(d, inter, e, k, layout, xdt):
  rng = np.random.default_rng(d + inter)
  w = _weights(rng, e, d, inter, layout)
  x = jnp.asarray(rng.normal(size=(d,)), xdt)
  ids = jnp.asarray(rng.integers(0, e, (k,)), jnp.int32)
  gates = jnp.asarray(rng.random(k) + 0.1, jnp.float32)
  got = jax.jit(cpu_host.host_experts, static_argnums=4)(x, ids, gates, w,
                                                         experts_lib.xla_experts)
  chex.assert_shape(got, (d,))
  chex.assert_type(got, xdt)
  want = experts_lib.xla_experts(f32(x)[None], ids[None], gates[None], _as_f32(w))[0]
  tol = 1e-5 if xdt == jnp.float32 else 1e-2     # bf16: the output's rounding
  chex.assert_trees_all_close(f32(got), want, atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)


def test_zero_gates_are_skipped_and_ids_clamped():
  rng = np.random.default_rng(0)
  w = _weights(rng, 4, 24, 8, "f32")
  x = jnp.asarray(rng.normal(size=(24,)), jnp.float32)
  nan = dict(w, gate_up=w["gate_up"].at[2].set(jnp.nan))     # expert 2: never read
  fn = jax.jit(cpu_host.host_experts, static_argnums=4)
  got = fn(x, jnp.array([2, 1, 9], jnp.int32), jnp.array([0.0, 0.5, 0.25]), nan,
           experts_lib.xla_experts)
  want = experts_lib.xla_experts(x[None], jnp.array([[1, 3]]), jnp.array([[0.5, 0.25]]), w)[0]
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  zero = fn(x, jnp.array([2], jnp.int32), jnp.array([0.0]), nan, experts_lib.xla_experts)
  chex.assert_trees_all_equal(zero, jnp.zeros_like(x))


@pytest.mark.parametrize("layout, xdt", [("f32", jnp.float32), ("bits", jnp.bfloat16)])
def test_rows_in_one_call_equal_one_call_per_row(layout, xdt):
  rng = np.random.default_rng(3)
  w = _weights(rng, 7, 72, 40, layout)
  x = jnp.asarray(rng.normal(size=(5, 72)), xdt)
  ids = jnp.asarray(rng.integers(0, 7, (5, 3)), jnp.int32)
  gates = jnp.asarray(rng.random((5, 3)) + 0.1, jnp.float32)
  gates = gates.at[2].set(0.0).at[4, 1].set(0.0)       # a row with no expert, a zero gate
  fn = jax.jit(cpu_host.host_experts, static_argnums=4)
  got = fn(x, ids, gates, w, experts_lib.xla_experts)
  chex.assert_shape(got, (5, 72))
  for b in range(5):     # the same bits as the row alone: the other rows change nothing
    chex.assert_trees_all_equal(got[b], fn(x[b], ids[b], gates[b], w, experts_lib.xla_experts))
  chex.assert_trees_all_equal(got[2], jnp.zeros((72,), xdt))
  want = experts_lib.xla_experts(f32(x), ids, gates, _as_f32(w))
  tol = 1e-5 if xdt == jnp.float32 else 1e-2
  chex.assert_trees_all_close(f32(got), want, atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=72, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=7, top_k=3,
                    moe_intermediate_size=40, intermediate_size=48, sparse_layers=(True,),
                    qk_norm="head").validate()
  ctx = types.SimpleNamespace(pinned=False, cfg=cfg)     # the engine's call: the sliced path
  dtypes = {n: (jnp.float32 if layout == "f32" else jnp.bfloat16) for n in w}
  sliced = jax.jit(lambda s, xx, i, g: sources.host_experts(ctx, s, dtypes, xx, i, g,
                                                            in_place=False))(w, x, ids, gates)
  chex.assert_trees_all_close(f32(got), f32(sliced), atol=tol * float(jnp.max(jnp.abs(want))),
                              rtol=0)


@pytest.mark.parametrize("layout", ["f32", "bits"])
def test_engine_host_call_uses_the_kernel_and_equals_the_sliced_path(layout):
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=40, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=6, top_k=3,
                    moe_intermediate_size=12, intermediate_size=48, sparse_layers=(True,),
                    qk_norm="head").validate()
  rng = np.random.default_rng(1)
  store = _weights(rng, 6, 40, 12, layout)
  dt = jnp.float32 if layout == "f32" else jnp.bfloat16
  dtypes = {"gate_up": dt, "down": dt}
  ctx = types.SimpleNamespace(pinned=False, cfg=cfg)
  x = jnp.asarray(rng.normal(size=(1, 1, 40)), dt)
  ids, gates = jnp.array([4, 0, 1], jnp.int32), jnp.array([0.6, 0.0, 0.3], jnp.float32)
  fn = lambda s, xx, i, g: sources.host_experts(ctx, s, dtypes, xx, i, g)
  assert cpu_kernel.HOST_EXPERTS_TARGET in jax.jit(fn).lower(store, x, ids, gates).as_text()
  slices = lambda s, xx, i, g: sources.host_experts(ctx, s, dtypes, xx, i, g, in_place=False)
  assert cpu_kernel.HOST_EXPERTS_TARGET not in jax.jit(slices).lower(store, x, ids,
                                                                     gates).as_text()
  got, want = jax.jit(fn)(store, x, ids, gates), jax.jit(slices)(store, x, ids, gates)
  chex.assert_shape(got, (1, 40))
  tol = 1e-5 if dt == jnp.float32 else 2e-2
  chex.assert_trees_all_close(f32(got), f32(want), atol=tol * float(jnp.max(jnp.abs(f32(want)))),
                              rtol=0)
