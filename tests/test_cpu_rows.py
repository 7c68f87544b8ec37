"""The row-wise CPU kernels (cpu_rows): RMSNorm, the softmax router rule, top-k, a
weighted bincount, the bf16 embedding lookup and the KV cache's in-place row write, each
pinned by a hand-checked case, compared with XLA's ops (f32 and bf16, odd widths, ties),
under vmap and grad, and compiled to one custom call where XLA needs several thunks (or
splits a tiny lookup over its thread pool); the page-cache hint (will_need) reads the
blocks it is asked for from a mapped file, and only those."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io import pages
from moejax.kernels import cpu_kernel, cpu_rows, layer_view
from moejax.model import layers, routing
from moejax.model.config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason="no C++ compiler: the kernel is not built")


def _norm(x, w, eps=1e-6):
  return jax.jit(layers.rms_norm, static_argnums=2)(x, w, eps)


def _route(logits, k, renorm):
  xla = lambda lg: routing.xla_softmax_rule(k, renorm, lg)
  return jax.jit(lambda lg: cpu_rows.route_softmax(lg, k, renorm, xla))(logits)


def _custom_calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().as_text().count("custom-call(")


def test_rms_norm_hand_checked():
  # x = [3, 4]: mean(x^2) = 12.5, x / sqrt(12.5) = [0.8485, 1.1314]; times w = [1, 2]
  x = jnp.array([[3.0, 4.0]])
  w = jnp.array([1.0, 2.0])
  r = 1.0 / np.sqrt(12.5)
  chex.assert_trees_all_close(_norm(x, w, 0.0), jnp.array([[3 * r, 8 * r]]), rtol=1e-6)
  # eps joins the mean: x = [1, 1], eps = 3 -> x / 2
  chex.assert_trees_all_close(_norm(jnp.ones((1, 2)), jnp.ones(2), 3.0),
                              jnp.full((1, 2), 0.5), rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 128), (2, 5, 37), (3, 4, 2, 16), (300, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_matches_xla(shape, dtype):
  rng = np.random.default_rng(shape[-1])
  x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
  w = jnp.asarray(rng.standard_normal(shape[-1]), dtype)
  got, want = _norm(x, w), layers.xla_rms_norm(x, w, 1e-6)
  chex.assert_type(got, want.dtype)
  chex.assert_equal_shape([got, want])
  # f32: the sum of squares in another order; bf16: at most one rounding step apart
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32),
                              rtol=tol, atol=tol)
  assert _custom_calls(lambda x: layers.rms_norm(x, w, 1e-6), x) == 1


def test_rms_norm_vmap_and_grad_follow_xla():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 3, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal(24), jnp.float32)
  chex.assert_trees_all_close(jax.vmap(lambda r: layers.rms_norm(r, w, 1e-6))(x),
                              layers.xla_rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
  assert _custom_calls(jax.vmap(lambda r: layers.rms_norm(r, w, 1e-6)), x) == 1
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w, 1e-6)))
  chex.assert_trees_all_close(jax.grad(loss(layers.rms_norm), (0, 1))(x, w),
                              jax.grad(loss(layers.xla_rms_norm), (0, 1))(x, w), rtol=1e-5,
                              atol=1e-5)


def test_rms_norm_other_dtypes_stay_with_xla():
  x = jnp.ones((2, 8), jnp.float32)
  w = jnp.ones(8, jnp.bfloat16)            # mixed dtypes: XLA's ops, promoted like before
  assert _custom_calls(lambda x: layers.rms_norm(x, w, 1e-6), x) == 0
  # both jitted: the same program either way (eager ops compile one at a time and, at
  # XLA's -O0 of launch/test.sh, round rsqrt's product one ulp apart)
  xla = jax.jit(layers.xla_rms_norm, static_argnums=2)
  chex.assert_trees_all_equal(_norm(x, w), xla(x, w, 1e-6))


def test_route_softmax_hand_checked():
  # probabilities [1, 2, 3, 1] / 7: top-2 = experts 2, 1 with 3/7, 2/7; renormalised 0.6, 0.4
  logits = jnp.log(jnp.array([[1.0, 2.0, 3.0, 1.0]]))
  ids, gates, scores = _route(logits, 2, True)
  chex.assert_trees_all_equal(ids, jnp.array([[2, 1]], jnp.int32))
  chex.assert_trees_all_close(gates, jnp.array([[0.6, 0.4]]), rtol=1e-6)
  chex.assert_trees_all_close(scores, jnp.array([[1, 2, 3, 1]]) / 7.0, rtol=1e-6)
  ids, gates, _ = _route(logits, 3, False)
  chex.assert_trees_all_equal(ids, jnp.array([[2, 1, 0]], jnp.int32))   # tie 0/3: lower index
  chex.assert_trees_all_close(gates, jnp.array([[3, 2, 1]]) / 7.0, rtol=1e-6)


@pytest.mark.parametrize("n,e,k,renorm", [(1, 64, 8, True), (37, 60, 4, False),
                                          (5, 256, 8, True), (3, 8, 8, True)])
def test_route_softmax_matches_xla(n, e, k, renorm):
  rng = np.random.default_rng(e)
  logits = jnp.asarray(rng.standard_normal((n, e)) * 2, jnp.float32)
  logits = logits.at[0, 1].set(logits[0, 0])        # a tie in row 0
  got, want = _route(logits, k, renorm), routing.xla_softmax_rule(k, renorm, logits)
  chex.assert_trees_all_equal(got[0], want[0])
  chex.assert_trees_all_close(got[1:], want[1:], rtol=1e-5, atol=1e-7)
  assert _custom_calls(lambda lg: routing.route(_cfg(e, k, renorm), lg), logits) == 1


def _cfg(e, k, renorm):
  return ModelConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=8, num_experts=e, top_k=k,
                     moe_intermediate_size=4, intermediate_size=8, sparse_layers=(True,),
                     norm_topk_prob=renorm)


def test_route_softmax_vmap_and_grad_follow_xla():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
  cfg = _cfg(16, 4, True)
  got = jax.vmap(lambda lg: routing.route(cfg, lg))(logits)
  want = jax.vmap(lambda lg: routing.xla_softmax_rule(4, True, lg))(logits)
  chex.assert_trees_all_equal(got[0], want[0])
  chex.assert_trees_all_close(got[1:], want[1:], rtol=1e-5, atol=1e-7)
  # gradients through the gates and the scores (train.py's balance loss) are XLA's
  loss = lambda f: lambda lg: jnp.sum(f(lg)[1] ** 2) + jnp.sum(jnp.cos(f(lg)[2]))
  chex.assert_trees_all_close(
      jax.grad(loss(lambda lg: routing.route(cfg, lg)))(logits[0]),
      jax.grad(loss(lambda lg: routing.xla_softmax_rule(4, True, lg)))(logits[0]), rtol=1e-5,
      atol=1e-7)


def _take(table, ids):
  return jax.jit(lambda t, i: cpu_rows.take_rows(t, i, _never))(table, ids)


def _never(*_):
  raise AssertionError("the kernel was expected, not the fallback")


def test_take_rows_hand_checked():
  # rows 2, 0, 2 of a 3 x 2 table; -1 counts from the end (row 2); 3 and -4 are out of
  # range: a row of NaN, as jnp.take gives
  table = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], jnp.bfloat16)
  got = np.asarray(_take(table, jnp.array([[2, 0], [2, -1]], jnp.int32)), np.float32)
  chex.assert_trees_all_equal(got, np.array([[[5, 6], [1, 2]], [[5, 6], [5, 6]]], np.float32))
  bad = np.asarray(_take(table, jnp.array([3, -4], jnp.int32)), np.float32)
  assert np.isnan(bad).all()


def test_take_rows_matches_jnp_take_bits_vmap_and_grad():
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(50, 37)), jnp.bfloat16)
  ids = jnp.asarray(rng.integers(-50, 50, (4, 6)), jnp.int32)
  want = jnp.take(table, ids, axis=0)
  chex.assert_trees_all_equal(_take(table, ids), want)
  vm = jax.jit(jax.vmap(lambda i: cpu_rows.take_rows(table, i, _never)))(ids)
  chex.assert_trees_all_equal(vm, want)
  # the gradient is jnp.take's: rows scattered back, summed over repeated ids
  ct = jnp.asarray(rng.normal(size=(4, 6, 37)), jnp.float32)
  loss = lambda t, f: jnp.sum(f(t).astype(jnp.float32) * ct)
  g = jax.grad(lambda t: loss(t, lambda u: cpu_rows.take_rows(u, ids, _never)))(table)
  g_want = jax.grad(lambda t: loss(t, lambda u: jnp.take(u, ids, axis=0)))(table)
  chex.assert_trees_all_equal(g, g_want)


def test_bf16_embedding_is_one_call_and_no_longer_split_over_the_pool():
  """The model's bf16 lookup: one custom call, and no fusion of the compiled decode step
  carries XLA's thread-pool split (outer_dimension_partitions)."""
  from moejax.model import model as model_lib
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=4096, hidden_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
                    moe_intermediate_size=32, intermediate_size=64,
                    sparse_layers=(True,)).validate()
  m = model_lib.Transformer(cfg, jnp.bfloat16)
  tok = jnp.zeros((1, 1), jnp.int32)
  exps = [{"gate_up": jnp.zeros((4, 64, 64), jnp.bfloat16),
           "down": jnp.zeros((4, 64, 32), jnp.bfloat16)}]
  params = m.init(jax.random.PRNGKey(0), tok, exps)["params"]
  hlo = jax.jit(lambda p, t: m.apply({"params": p}, t, exps)[0]).lower(
      params, tok).compile().as_text()
  assert hlo.count('custom_call_target="moejax_take_rows"') == 1
  assert "outer_dimension_partitions" not in hlo
  x = m.apply({"params": params}, tok, method=model_lib.Transformer.embed)
  chex.assert_trees_all_equal(x, jnp.take(params["embed_tokens"]["embedding"], tok, axis=0))


def test_top_k_hand_checked():
  # values descending; ties to the lower index (1 before 3); -inf last, by index
  x = jnp.array([[1.0, 5.0, -jnp.inf, 5.0, 2.0, -jnp.inf]])
  vals, ids = jax.jit(lambda a: cpu_rows.top_k(a, 5))(x)
  np.testing.assert_array_equal(np.asarray(ids), [[1, 3, 4, 0, 2]])
  np.testing.assert_array_equal(np.asarray(vals), [[5.0, 5.0, 2.0, 1.0, -np.inf]])
  assert _custom_calls(lambda a: cpu_rows.top_k(a, 5), x) == 1


@pytest.mark.parametrize("k", [1, 8, 17, 128])
def test_top_k_matches_lax_top_k_bits_with_ties_and_under_vmap(k):
  rng = np.random.default_rng(k)
  x = rng.integers(-3, 4, (4, 5, 128)).astype(np.float32)     # many ties
  x[x == -3] = -np.inf
  x[0, 0] = -np.inf                                             # a row with nothing left
  want = jax.lax.top_k(x, k)
  got = jax.jit(jax.vmap(jax.vmap(lambda a: cpu_rows.top_k(a, k))))(x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  x = rng.standard_normal((3, 128)).astype(np.float32)
  for g, w in zip(jax.jit(lambda a: cpu_rows.top_k(a, k))(x), jax.lax.top_k(x, k)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_first_k_is_the_first_set_positions():
  from moejax.cache.step import first_k
  rng = np.random.default_rng(0)
  m = rng.random((40, 128)) < 0.04
  m[0], m[1] = False, True
  got = np.asarray(jax.jit(jax.vmap(lambda a: first_k(a, 8)))(m))
  for r in range(40):
    want = list(np.nonzero(m[r])[0][:8])
    assert list(got[r]) == want + [-1] * (8 - len(want)), r


def test_bin_sum_hand_checked_and_matches_the_one_hot_sum():
  ids = jnp.array([[2, 0, 2, -1, 5]], jnp.int32)      # -1 and 5 (>= bins) add nothing
  w = jnp.array([[0.5, 1.0, 0.25, 9.0, 9.0]])
  got = jax.jit(lambda i, x: cpu_rows.bin_sum(i, x, 4))(ids, w)
  np.testing.assert_array_equal(np.asarray(got), [[1.0, 0.0, 0.75, 0.0]])
  assert _custom_calls(lambda i, x: cpu_rows.bin_sum(i, x, 4), ids, w) == 1
  rng = np.random.default_rng(0)
  ids = rng.permuted(np.tile(np.arange(128), (3, 5, 1)), axis=-1)[..., :8].astype(np.int32)
  w = rng.random((3, 5, 8)).astype(np.float32)
  want = jnp.sum(jnp.where(ids[..., :, None] == jnp.arange(128), w[..., :, None], 0.0), axis=-2)
  got = jax.jit(jax.vmap(jax.vmap(lambda i, x: cpu_rows.bin_sum(i, x, 128))))(ids, w)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))   # distinct ids: exact


def test_write_rows_is_a_dynamic_update_slice_in_place():
  rng = np.random.default_rng(4)
  cache = jnp.asarray(rng.normal(size=(3, 10, 2, 4)), jnp.bfloat16)
  rows = jnp.asarray(rng.normal(size=(2, 3, 2, 4)), jnp.bfloat16)
  dus = lambda c, r, b, s: jax.lax.dynamic_update_slice(c, r, (b, s, 0, 0))
  fn = jax.jit(lambda c, r, b, s: cpu_rows.write_rows(c, r, (b, s), lambda c, r: dus(c, r, b, s)))
  assert _custom_calls(fn, cache, rows, 0, 0) == 1
  for b, s in ((0, 0), (1, 4), (1, 9), (-1, -2), (5, 20)):     # clamped as XLA clamps
    chex.assert_trees_all_equal(fn(cache, rows, b, s), dus(cache, rows, b, s))
  # under vmap (one call per element) and through the model's cache write, a row each
  one_each = rows[:1].repeat(3, 0)[:, None]
  got = jax.jit(jax.vmap(fn, in_axes=(0, 0, None, 0)))(cache[:, None], one_each, 0,
                                                      jnp.array([0, 5, 7]))
  want = jax.vmap(dus, in_axes=(0, 0, None, 0))(cache[:, None], one_each, 0, jnp.array([0, 5, 7]))
  chex.assert_trees_all_equal(got, want)
  ends = jnp.array([2, 0, 9])
  got = jax.jit(layers.write_cache)(cache, rows[:1, :1].repeat(3, 0), ends)
  want = jnp.stack([dus(cache[i:i + 1], rows[:1, :1], 0, int(ends[i]))[0] for i in range(3)])
  chex.assert_trees_all_equal(got, want)
  # a stack [L, B, S, ...] at (l, b, s), and rows at one leading index
  stack = jnp.asarray(rng.normal(size=(2, 3, 10, 2, 4)), jnp.bfloat16)
  dus3 = lambda c, r, i: jax.lax.dynamic_update_slice(c, r, tuple(i) + (0, 0))
  for i in ((1, 2, 4), (0, 0, 9), (-1, 1, 0)):
    r = rows[None, :, :2]
    got = jax.jit(lambda c, r: cpu_rows.write_rows(c, r, i, lambda c, r: dus3(c, r, i)))(stack, r)
    chex.assert_trees_all_equal(got, dus3(stack, r, i))
  one = rows[:1, :1]
  got = jax.jit(lambda c, r: cpu_rows.write_rows(c, r, (2,), lambda c, r: dus(c, r, 2, 0)))(
      cache, jnp.broadcast_to(one, (1, 10, 2, 4)))
  chex.assert_trees_all_equal(got, dus(cache, jnp.broadcast_to(one, (1, 10, 2, 4)), 2, 0))


def test_copy_rows_copies_a_block_from_one_buffer_into_another_in_place():
  rng = np.random.default_rng(5)
  # slot buffers [L, P, ...] and a store [L, E, ...]; a 2.4 MB block is copied in 10 pieces
  # on 2 threads (9 of 256 KB rounded up to a multiple of the threads), a 1.02 MB one in 4
  # of 254,528 bytes (the last one shorter)
  for shape in ((3, 4, 6), (96, 128, 96), (97, 128, 41)):
    buf = jnp.asarray(rng.normal(size=(2, 5) + shape), jnp.bfloat16)
    store = jnp.asarray(rng.normal(size=(2, 7) + shape), jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(store, jnp.uint16)      # a store of bf16 bits

    def want(b, s, d_at, s_at):
      blk = jax.lax.dynamic_slice(s, s_at + (0,) * len(shape), (1, 1) + shape)
      blk = jax.lax.bitcast_convert_type(blk, b.dtype) if blk.dtype != b.dtype else blk
      return jax.lax.dynamic_update_slice(b, blk, d_at + (0,) * len(shape))
    for src in (store, bits):
      for d_at, s_at in (((1, 3), (0, 6)), ((0, 0), (1, 2)), ((1, 9), (1, 20))):   # clamped
        fn = jax.jit(lambda b, s: cpu_rows.copy_rows(b, d_at, s, s_at,
                                                     lambda b, s: want(b, s, d_at, s_at)))
        assert _custom_calls(fn, buf, src) == 1
        chex.assert_trees_all_equal(fn(buf, src), want(buf, store, d_at, s_at))
  # through layer_view.copy_row: a plain buffer, and views of stacks in a scan's body
  got = jax.jit(lambda b, s: layer_view.copy_row(b, 2, s, 5))(buf[0], store[0])
  chex.assert_trees_all_equal(got, buf[0].at[2].set(store[0, 5]))

  def body(b, i):
    with layer_view.tracing():
      new = layer_view.copy_row(layer_view.at(b, i), 4 - i, layer_view.at(store, i), 2 * i + 1)
      out = layer_view.stack_at(new, i)
      assert out is not None
      return out, None
  got, _ = jax.jit(lambda b: jax.lax.scan(body, b, jnp.arange(2)))(buf)
  chex.assert_trees_all_equal(got, buf.at[0, 4].set(store[0, 1]).at[1, 3].set(store[1, 3]))


def test_will_need_reads_the_asked_blocks_of_a_mapped_file_and_only_those(tmp_path):
  import os, time   # pylint: disable=import-outside-toplevel,multiple-imports
  path = tmp_path / "store.bin"
  np.arange(2 * 8 * 64 * 1024, dtype=np.float32).reshape(2, 8, 64, 1024).tofile(path)
  fd = os.open(path, os.O_RDONLY)
  os.fsync(fd)
  os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  os.close(fd)
  mapped = np.memmap(path, np.float32, "r", shape=(2, 8, 64, 1024))   # blocks of 256 KB
  if pages.resident(mapped) is None or pages.resident(mapped).any():
    pytest.skip("no mincore here, or the file system kept the pages after POSIX_FADV_DONTNEED")
  store = jax.device_put(mapped)                 # the CPU client maps it in place
  at = jnp.array([[1, 2], [0, 7], [1, 5]], jnp.int32)
  assert int(jax.jit(cpu_rows.will_need)(store, at, jnp.int32(2))) == 2
  want = np.zeros(16, bool)
  want[[8 + 2, 7]] = True                        # (1, 2) and (0, 7); (1, 5) is past n
  for _ in range(200):                           # the reads were queued, not waited for
    got = pages.resident(mapped).reshape(16, -1)
    if got[want].all():
      break
    time.sleep(0.01)
  assert got[want].all() and not got[~want].any(), got.any(axis=1)
