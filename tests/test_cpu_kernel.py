"""The C++ CPU expert kernel: a hand-checked case, agreement with XLA's dispatch, zero-gate
pairs skipped, gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import cpu_kernel, cpu_matmul
from moejax.model import experts as experts_lib

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason="no C++ compiler: the kernel is not built")


def _kernel(x, ids, gates, w):
  return jax.jit(cpu_matmul.expert_ffn, static_argnums=4)(x, ids, gates, w,
                                                          experts_lib.xla_experts)


def test_hand_checked_single_expert():
  # D=2, I=1: gate row [1, 0], up row [0, 1], down [[2], [3]]; x = [1, 2]
  # h_gate = 1, h_up = 2, a = silu(1) * 2; y = gate 0.5 * [2a, 3a]
  gu = jnp.array([[[1.0, 0.0], [0.0, 1.0]], [[9.0, 9.0], [9.0, 9.0]]])
  dn = jnp.array([[[2.0], [3.0]], [[9.0], [9.0]]])
  x = jnp.array([[1.0, 2.0]])
  y = _kernel(x, jnp.array([[0]], jnp.int32), jnp.array([[0.5]]), {"gate_up": gu, "down": dn})
  a = 1.0 / (1.0 + np.exp(-1.0)) * 2.0
  chex.assert_trees_all_close(np.asarray(y), np.array([[0.5 * 2 * a, 0.5 * 3 * a]]), rtol=1e-6)


@pytest.mark.parametrize("n", [2, 40])      # decode items and prompt blocks
def test_pairs_with_gate_zero_are_not_computed(n):
  rng = np.random.default_rng(7)
  w = {"gate_up": jnp.asarray(rng.normal(size=(4, 12, 16)) * 0.3, jnp.float32),
       "down": jnp.asarray(rng.normal(size=(4, 16, 6)) * 0.3, jnp.float32)}
  x = jnp.asarray(rng.normal(size=(n, 16)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 3, (n, 3)), jnp.int32).at[:, 1].set(3)
  gates = jnp.asarray(rng.random((n, 3)) + 0.1, jnp.float32).at[:, 1].set(0.0)
  nan = dict(w, gate_up=w["gate_up"].at[3].set(jnp.nan))    # expert 3: gate 0 wherever used
  got = _kernel(x, ids, gates, nan)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_equal(got, _kernel(x, ids, gates, w))
  none = _kernel(x, ids, jnp.zeros_like(gates), nan)        # every gate 0: zeros
  chex.assert_trees_all_equal(none, jnp.zeros_like(x))


@pytest.mark.parametrize("n, e, d, inter, k", [(1, 16, 64, 32, 4),      # decode
                                               (3, 5, 20, 6, 2),        # tails (not x8)
                                               (70, 8, 24, 16, 3)])     # blocks of 32
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_xla_dispatch(n, e, d, inter, k, dtype):
  rng = np.random.default_rng(n)
  w = {"gate_up": jnp.asarray(rng.normal(size=(e, 2 * inter, d)) * 0.3, dtype),
       "down": jnp.asarray(rng.normal(size=(e, d, inter)) * 0.3, dtype)}
  x = jnp.asarray(rng.normal(size=(n, d)), dtype)
  ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
  gates = jnp.asarray(rng.random((n, k)), jnp.float32)
  got = _kernel(x, ids, gates, w)
  chex.assert_type(got, x.dtype)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  want = experts_lib.xla_experts(f32(x), ids, gates, jax.tree.map(f32, w))
  tol = 1e-5 if dtype == jnp.float32 else 1e-2    # bf16: the output's rounding
  chex.assert_trees_all_close(f32(got), want, atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)


def test_apply_experts_uses_kernel_and_gradients_match_xla():
  rng = np.random.default_rng(0)
  w = {"gate_up": jnp.asarray(rng.normal(size=(6, 8, 12)) * 0.3, jnp.float32),
       "down": jnp.asarray(rng.normal(size=(6, 12, 4)) * 0.3, jnp.float32)}
  x = jnp.asarray(rng.normal(size=(5, 12)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 6, (5, 2)), jnp.int32)
  gates = jnp.asarray(rng.random((5, 2)), jnp.float32)
  hlo = jax.jit(experts_lib.apply_experts).lower(x, ids, gates, w).as_text()
  assert cpu_kernel.TARGET in hlo
  with cpu_kernel.enabled(False):  # a new function: jit caches traces per function
    assert cpu_kernel.TARGET not in jax.jit(lambda *a: experts_lib.apply_experts(*a)).lower(
        x, ids, gates, w).as_text()
  loss = lambda fn: lambda x, g, w: jnp.sum(jnp.sin(fn(x, ids, g, w)))
  got = jax.grad(loss(experts_lib.apply_experts), argnums=(0, 1, 2))(x, gates, w)
  want = jax.grad(loss(experts_lib.xla_experts), argnums=(0, 1, 2))(x, gates, w)
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


def test_linear_hand_checked_and_matches_einsum():
  x = jnp.array([[1.0, 2.0, 3.0]])
  w = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
  chex.assert_trees_all_close(jax.jit(cpu_matmul.linear)(x, w), jnp.array([[1.0, 5.0]]))
  rng = np.random.default_rng(0)
  for n, o, d in [(1, 130, 40), (5, 64, 72)]:
    for dtype in (jnp.float32, jnp.bfloat16):
      x = jnp.asarray(rng.normal(size=(n, d)), dtype)
      w = jnp.asarray(rng.normal(size=(o, d)), dtype)
      got = jax.jit(cpu_matmul.linear)(x, w)
      chex.assert_type(got, dtype)
      want = jnp.asarray(x, jnp.float32) @ jnp.asarray(w, jnp.float32).T
      tol = 1e-5 if dtype == jnp.float32 else 1e-2
      chex.assert_trees_all_close(jnp.asarray(got, jnp.float32), want,
                                  atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)
  assert cpu_kernel.LINEAR_TARGET in jax.jit(cpu_matmul.linear).lower(x, w).as_text()
  g = jax.grad(lambda x, w: jnp.sum(jnp.sin(cpu_matmul.linear(x, w))), argnums=(0, 1))
  gx = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w.T)), argnums=(0, 1))
  x32, w32 = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
  chex.assert_trees_all_close(g(x32, w32), gx(x32, w32), rtol=1e-4, atol=1e-4)


def test_linears_run_as_one_kernel_call():
  """q/k/v of one input: one kernel call with three results, each x @ w.T (hand-checked
  rows, then random f32/bf16 against einsum), under vmap, and with XLA's gradients."""
  x = jnp.array([[1.0, 2.0, 3.0]])
  ws = (jnp.array([[1.0, 0.0, 0.0]]), jnp.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
        jnp.array([[2.0, 0.0, -1.0]]))
  with cpu_kernel.enabled(True):
    old = cpu_matmul.LINEAR_MIN_F32_BYTES
    cpu_matmul.LINEAR_MIN_F32_BYTES = 0
    try:
      fn = jax.jit(lambda x, ws: cpu_matmul.linears(x, ws))
      got = fn(x, ws)
      hlo = fn.lower(x, ws).as_text()
    finally:
      cpu_matmul.LINEAR_MIN_F32_BYTES = old
  chex.assert_trees_all_close(got, (jnp.array([[1.0]]), jnp.array([[5.0, 6.0]]),
                                    jnp.array([[-1.0]])))
  assert hlo.count(cpu_kernel.LINEAR_TARGET) == 1 and "dot" not in hlo
  rng = np.random.default_rng(3)
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.normal(size=(3, 600)), dtype)
    ws = tuple(jnp.asarray(rng.normal(size=(o, 600)), dtype) for o in (512, 256, 130))
    fn = jax.jit(lambda x, ws: cpu_matmul.linears(x, ws))  # 1.9 MB in f32: the kernel
    assert fn.lower(x, ws).as_text().count(cpu_kernel.LINEAR_TARGET) == 1
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for y, w in zip(fn(x, ws), ws):
      chex.assert_type(y, dtype)
      chex.assert_shape(y, (3, w.shape[0]))
      want = jnp.asarray(x, jnp.float32) @ jnp.asarray(w, jnp.float32).T
      chex.assert_trees_all_close(jnp.asarray(y, jnp.float32), want,
                                  atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)
  x, ws = jnp.asarray(x, jnp.float32), tuple(jnp.asarray(w, jnp.float32) for w in ws)
  xb = jnp.stack([x, 2 * x])
  got = jax.jit(jax.vmap(lambda x: cpu_matmul.linears(x, ws)))(xb)
  for b in range(2):
    for y, w in zip(got, ws):
      chex.assert_trees_all_close(y[b], xb[b] @ w.T, rtol=1e-4, atol=1e-3)
  x = x / 30   # outputs of order 1: sin's gradient does not amplify rounding
  loss = lambda f: lambda x, ws: sum(jnp.sum(jnp.sin(y)) for y in f(x, ws))
  g = jax.grad(loss(cpu_matmul.linears), argnums=(0, 1))(x, ws)
  gx = jax.grad(loss(lambda x, ws: [x @ w.T for w in ws]), argnums=(0, 1))(x, ws)
  chex.assert_trees_all_close(g, gx, rtol=1e-4, atol=1e-4)


def test_spinning_helpers_and_pool_tasks_give_the_same_bits():
  """A decode call's work items go to the kernel's spinning helper threads (default) or to
  tasks on XLA's pool (set_spin_us(0)); which thread computes an item changes no bit, for
  decode-sized calls and a prompt-sized one (always the pool), repeated back to back."""
  rng = np.random.default_rng(4)
  w = {"gate_up": jnp.asarray(rng.normal(size=(16, 64, 96)), jnp.float32),
       "down": jnp.asarray(rng.normal(size=(16, 96, 32)), jnp.float32)}
  ws = tuple(jnp.asarray(rng.normal(size=(o, 96)), jnp.float32) for o in (1024, 512))
  fn = jax.jit(lambda x, ids, g: (experts_lib.apply_experts(x, ids, g, w),
                                  cpu_matmul.linears(x, ws)))
  def run():
    out = []
    for n in (1, 4, 40):
      x = jnp.asarray(rng.normal(size=(n, 96)), jnp.float32)
      ids = jnp.asarray(rng.integers(0, 16, (n, 4)), jnp.int32)
      g = jnp.asarray(rng.random((n, 4)), jnp.float32)
      out += [fn(x, ids, g) for _ in range(3)]
    return jax.device_get(out)
  state = rng.bit_generator.state
  try:
    assert cpu_kernel.set_spin_us(0)
    pooled = run()
    rng.bit_generator.state = state
    assert cpu_kernel.set_spin_us(1000)
    spun = run()
  finally:
    cpu_kernel.set_spin_us(1000)
  chex.assert_trees_all_equal(pooled, spun)
  ids = jnp.zeros((1, 4), jnp.int32)
  want = experts_lib.xla_experts(jnp.ones((1, 96)), ids, jnp.ones((1, 4)), w)
  chex.assert_trees_all_close(fn(jnp.ones((1, 96)), ids, jnp.ones((1, 4)))[0], want,
                              rtol=1e-4, atol=1e-3)


def test_decode_calls_in_finer_items_give_the_same_bits_as_prompt_calls():
  """Up to 16 tokens run in finer items (gate/up rows, then down rows); more run one item
  per expert block. Each row's dot is the same either way, so the first 16 tokens of a
  17-token call equal a 16-token call bit for bit, in f32 and bf16."""
  rng = np.random.default_rng(5)
  for dtype in (jnp.float32, jnp.bfloat16):
    w = {"gate_up": jnp.asarray(rng.normal(size=(8, 2 * 72, 136)), dtype),
         "down": jnp.asarray(rng.normal(size=(8, 136, 72)), dtype)}
    x = jnp.asarray(rng.normal(size=(17, 136)), dtype)
    ids = jnp.asarray(np.stack([rng.permutation(8)[:3] for _ in range(17)]), jnp.int32)
    g = jnp.asarray(rng.random((17, 3)), jnp.float32)
    fn = jax.jit(experts_lib.apply_experts)
    many, few = fn(x, ids, g, w), fn(x[:16], ids[:16], g[:16], w)
    chex.assert_trees_all_equal(np.asarray(many[:16]), np.asarray(few))
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    want = experts_lib.xla_experts(*(jnp.asarray(a, jnp.float32) for a in (x[:16],)),
                                   ids[:16], g[:16], jax.tree.map(
                                       lambda a: jnp.asarray(a, jnp.float32), w))
    chex.assert_trees_all_close(jnp.asarray(few, jnp.float32), want,
                                atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,inter", [(37, 13), (173, 70)])
def test_a_tokens_bits_do_not_depend_on_the_tile_it_lands_in(dtype, d, inter):
  """A prompt's rows run in tiles (f32: 8 rows x 2 tokens, bf16: 4 x 8, or 8 x 3 with 16
  lanes), then 4-row and single-row remainders; a row's length may have a tail beyond the
  lanes (or the 32-element chunks of bf16 pairs). Each token of a 41-token prompt call
  equals, bit for bit, the same token computed alone (the one-row decode path): D=37
  (tail 5, 37 down rows = 8+8+8+8+4+1), I=13 (26 gate/up rows); D=173 (five chunks of bf16
  pairs, four chains and one more, tail 13), I=70."""
  rng = np.random.default_rng(11)
  e, k, n = 6, 3, 41
  w = {"gate_up": jnp.asarray(rng.normal(size=(e, 2 * inter, d)), dtype),
       "down": jnp.asarray(rng.normal(size=(e, d, inter)), dtype)}
  x = jnp.asarray(rng.normal(size=(n, d)), dtype)
  ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]), jnp.int32)
  g = jnp.asarray(rng.random((n, k)), jnp.float32)
  fn = jax.jit(experts_lib.apply_experts)
  prompt = np.asarray(fn(x, ids, g, w))
  alone = np.concatenate([np.asarray(fn(x[i:i + 1], ids[i:i + 1], g[i:i + 1], w))
                          for i in range(n)])
  chex.assert_trees_all_equal(prompt, alone)


def test_describe_names_the_dots_this_build_runs():
  """describe() (a benchmark's record) names the lane count, and bf16 pairs only where
  the dots are 16 lanes wide (AVX512-BF16 implies AVX-512); "off" without the kernels."""
  want = f"{cpu_kernel.lanes()}-lane dots"
  assert cpu_kernel.describe() in (want, want + ", bf16 pairs")
  if cpu_kernel.lanes() == 8:
    assert "pairs" not in cpu_kernel.describe()
  with cpu_kernel.enabled(False):
    assert cpu_kernel.describe() == "off"
    assert cpu_kernel.lanes() == 0


def test_vmap_folds_the_batch_into_one_kernel_call(monkeypatch):
  """vmap with shared weights (the emulator's streams): one kernel call over B*N rows,
  no loop; with per-element weights: one call per element. Both equal XLA's result."""
  monkeypatch.setattr(cpu_matmul, "LINEAR_MIN_F32_BYTES", 0)   # small f32 linears too
  rng = np.random.default_rng(1)
  w = {"gate_up": jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32),
       "down": jnp.asarray(rng.normal(size=(4, 16, 4)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(3, 2, 16)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 4, (3, 2, 2)), jnp.int32)
  gates = jnp.asarray(rng.random((3, 2, 2)), jnp.float32)
  want = jnp.stack([experts_lib.xla_experts(x[b], ids[b], gates[b], w) for b in range(3)])
  shared = jax.jit(jax.vmap(lambda *a: experts_lib.apply_experts(*a), in_axes=(0, 0, 0, None)))
  hlo = shared.lower(x, ids, gates, w).as_text()
  assert cpu_kernel.TARGET in hlo and "while" not in hlo and "6x16" in hlo   # B*N = 6 rows
  chex.assert_trees_all_close(shared(x, ids, gates, w), want, rtol=1e-5, atol=1e-5)
  # unbatched ids broadcast to the batch; nested vmap folds both axes
  got = jax.jit(jax.vmap(lambda x: experts_lib.apply_experts(x, ids[0], gates[0], w)))(x)
  want0 = jnp.stack([experts_lib.xla_experts(x[b], ids[0], gates[0], w) for b in range(3)])
  chex.assert_trees_all_close(got, want0, rtol=1e-5, atol=1e-5)
  nested = jax.jit(jax.vmap(jax.vmap(lambda *a: experts_lib.apply_experts(*a),
                                     in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, None)))
  xx, ii, gg = (jnp.stack([a, a[::-1]]) for a in (x, ids, gates))
  chex.assert_trees_all_close(nested(xx, ii, gg, w), jnp.stack([want, want[::-1]]),
                              rtol=1e-5, atol=1e-5)
  # per-element weights: a loop of kernel calls
  wb = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a, -a]), w)
  per = jax.jit(jax.vmap(lambda *a: experts_lib.apply_experts(*a)))
  wantb = jnp.stack([experts_lib.xla_experts(
      x[b], ids[b], gates[b], jax.tree_util.tree_map(lambda a: a[b], wb)) for b in range(3)])
  chex.assert_trees_all_close(per(x, ids, gates, wb), wantb, rtol=1e-5, atol=1e-4)
  lin = jax.jit(jax.vmap(lambda x, w: cpu_matmul.linear(x, w), in_axes=(0, None)))
  assert cpu_kernel.LINEAR_TARGET in lin.lower(x, w["gate_up"][0]).as_text()
  chex.assert_trees_all_close(lin(x, w["gate_up"][0]),
                              jnp.einsum("bnd,od->bno", x, w["gate_up"][0]), rtol=1e-5,
                              atol=1e-5)


def test_linear_f32_kernel_only_for_large_weights(monkeypatch):
  """Small f32 projections stay with XLA (the custom call costs more than their dot);
  large ones and every bf16 one go to the kernel, and all of them agree with einsum."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(1, 64)), jnp.float32)
  small = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)          # 8 KiB
  assert cpu_kernel.LINEAR_TARGET not in jax.jit(cpu_matmul.linear).lower(x, small).as_text()
  assert cpu_kernel.LINEAR_TARGET in jax.jit(cpu_matmul.linear).lower(
      x.astype(jnp.bfloat16), small.astype(jnp.bfloat16)).as_text()
  big = jnp.asarray(rng.normal(size=(cpu_matmul.LINEAR_MIN_F32_BYTES // 256, 64)), jnp.float32)
  assert cpu_kernel.LINEAR_TARGET in jax.jit(cpu_matmul.linear).lower(x, big).as_text()
  chex.assert_trees_all_close(jax.jit(cpu_matmul.linear)(x, big), x @ big.T, rtol=1e-5,
                              atol=1e-4)
  monkeypatch.setattr(cpu_matmul, "LINEAR_MIN_F32_BYTES", 0)   # the kernel's f32 path, small
  f = lambda x, w: cpu_matmul.linear(x, w)                     # a new function: a new trace
  assert cpu_kernel.LINEAR_TARGET in jax.jit(f).lower(x, small).as_text()
  chex.assert_trees_all_close(jax.jit(f)(x, small), x @ small.T, rtol=1e-5, atol=1e-5)


def test_bf16_prompt_rows_take_the_kernel_up_to_its_limit(monkeypatch):
  """bf16 x of up to LINEAR_MAX_TOKENS_BF16 rows (LINEAR_MAX_TOKENS_BF16_WIDE where the
  dots are 16 lanes wide) goes to the kernel (XLA's GEMM converts the whole weight to f32
  at every call), f32 of more than LINEAR_MAX_TOKENS to XLA; in the kernel each row has
  the bits it gets alone."""
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.normal(size=(96, 72)), jnp.bfloat16)
  lowered = lambda n, dt: jax.jit(cpu_matmul.linear).lower(
      jnp.zeros((n, 72), dt), w.astype(dt)).as_text()
  assert cpu_kernel.lanes() in (8, 16)
  n = (cpu_matmul.LINEAR_MAX_TOKENS_BF16_WIDE if cpu_kernel.lanes() == 16
       else cpu_matmul.LINEAR_MAX_TOKENS_BF16)
  assert cpu_kernel.LINEAR_TARGET in lowered(n, jnp.bfloat16)
  assert cpu_kernel.LINEAR_TARGET not in lowered(n + 1, jnp.bfloat16)
  monkeypatch.setattr(cpu_matmul, "LINEAR_MIN_F32_BYTES", 0)   # f32 by rows alone
  assert cpu_kernel.LINEAR_TARGET not in jax.jit(lambda x, w: cpu_matmul.linear(x, w)).lower(
      jnp.zeros((cpu_matmul.LINEAR_MAX_TOKENS + 1, 72)), w.astype(jnp.float32)).as_text()
  x = jnp.asarray(rng.normal(size=(n, 72)), jnp.bfloat16)
  whole = np.asarray(jax.jit(cpu_matmul.linear)(x, w), np.float32)
  for i in (0, 17, n - 1):
    alone = np.asarray(jax.jit(cpu_matmul.linear)(x[i:i + 1], w), np.float32)
    np.testing.assert_array_equal(whole[i:i + 1], alone)
