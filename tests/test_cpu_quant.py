"""The CPU kernels on GGUF quantized weights (cpu_quant): every kernel and type against a
numpy dequantize-then-dot reference, the accuracy bound of the 8-bit activations, a token's
bits alone and in a prompt, gate-0 pairs, stacked layers, vmap and the dequantizing path
of other backends."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import cpu_kernel, cpu_quant, layer_view
from tests.quant_reference import (BLOCK, act_bound, dequantize, quantize_act, random_blocks,
                                   ref_linear)

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason="no C++ compiler: the kernels are not built")
TYPES = ("q8_0", "q4_0", "q4_k", "q6_k")


def f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


# ---- tests ----

@pytest.mark.parametrize("qtype", TYPES)
def test_numpy_and_jax_dequantizers_agree_with_gguf(qtype):
  """The tests' numpy dequantizers and cpu_quant.dequantize (other backends) give gguf-py's
  values for the same blocks (skipped where gguf is not installed)."""
  rng = np.random.default_rng(1)
  blocks = random_blocks(rng, qtype, 6, 512)
  ours = dequantize(blocks, qtype)
  chex.assert_trees_all_close(f32(cpu_quant.dequantize(jnp.asarray(blocks), qtype)),
                              ours.astype(np.float32), rtol=1e-6, atol=0)
  gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
  theirs = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype.upper()))
  np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_q_matches_the_reference(qtype, n, dtype):
  """70 rows (tiles of 4 and 2, remainders); rows of 3 blocks of 32 (a last group of 3
  in the AVX-512 steps of 4 blocks, read up to the row's end) or 2 super-blocks. Against the reference with x rounded as
  the kernel rounds it: f32 rounding only. Against the exact dot: within the 8-bit
  activation's bound (act_bound) plus the output's rounding."""
  rng = np.random.default_rng(n)
  cols = 96 if BLOCK[qtype][0] == 32 else 512
  blocks = random_blocks(rng, qtype, 70, cols)
  x = jnp.asarray(rng.normal(size=(n, cols)), dtype)
  got = jax.jit(cpu_quant.linear_q, static_argnums=2)(x, jnp.asarray(blocks), qtype)
  chex.assert_type(got, dtype)
  chex.assert_shape(got, (n, 70))
  exact, rounded = ref_linear(f32(x), blocks, qtype)
  scale = np.abs(f32(x)) @ np.abs(dequantize(blocks, qtype)).T
  out_tol = 1e-5 if dtype == jnp.float32 else 2 ** -8
  assert np.all(np.abs(f32(got) - rounded) <= 1e-5 * scale + out_tol * np.abs(rounded))
  bound = act_bound(f32(x), dequantize(blocks, qtype), BLOCK[qtype][0])
  assert np.all(np.abs(f32(got) - exact) <= bound + 1e-5 * scale + out_tol * np.abs(exact))
  assert cpu_kernel.LINEAR_Q_TARGET in jax.jit(
      lambda x, b: cpu_quant.linear_q(x, b, qtype)).lower(x, jnp.asarray(blocks)).as_text()


@needs_kernel
def test_linears_q_one_call_for_several_types():
  """q, k, v of one input in one kernel call, each its own type, each as linear_q alone."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(3, 512)), jnp.float32)
  ws = [(jnp.asarray(random_blocks(rng, q, o, 512)), q) for q, o in
        (("q8_0", 64), ("q4_k", 130), ("q6_k", 8), ("q4_0", 256))]
  fn = jax.jit(lambda x, bs: cpu_quant.linears_q(x, [(b, q) for b, (_, q) in zip(bs, ws)]))
  got = fn(x, [b for b, _ in ws])
  assert fn.lower(x, [b for b, _ in ws]).as_text().count(cpu_kernel.LINEAR_Q_TARGET) == 1
  for y, (b, q) in zip(got, ws):
    chex.assert_trees_all_equal(y, jax.jit(cpu_quant.linear_q, static_argnums=2)(x, b, q))


def _experts(rng, qgu, qdn, e, d, inter, fused):
  gate_up = random_blocks(rng, qgu, e * 2 * inter, d).reshape(e, 2 * inter, -1)
  down = random_blocks(rng, qdn, e * d, inter).reshape(e, d, -1)
  if fused:
    return {"gate_up": gate_up, "down": down}, {"gate_up": qgu, "down": qdn}
  return ({"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": down},
          {"gate": qgu, "up": qgu, "down": qdn})


def ref_experts(x, ids, gates, w, qt, rounded):
  """The SwiGLU experts on the dequantized weights, float64: x (and the activations
  before down) exact, or rounded as the kernel rounds them."""
  x = np.asarray(x, np.float64)
  gu = w["gate_up"] if "gate_up" in w else np.concatenate([w["gate"], w["up"]], axis=1)
  qgu, qdn = qt.get("gate_up", qt.get("gate")), qt["down"]
  e, inter = gu.shape[0], gu.shape[1] // 2
  deq_gu = [dequantize(gu[i], qgu) for i in range(e)]
  deq_dn = [dequantize(w["down"][i], qdn) for i in range(e)]
  rnd = lambda v, q: quantize_act(v, BLOCK[q][0]) if rounded else v
  y = np.zeros_like(x)
  for n in range(x.shape[0]):
    for k in range(ids.shape[1]):
      i = ids[n, k]
      h = rnd(x[n:n + 1], qgu) @ deq_gu[i].T
      a = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]
      y[n] += gates[n, k] * (rnd(a, qdn) @ deq_dn[i].T)[0]
  return y


def _ffn(x, ids, gates, w, qt):
  fn = jax.jit(lambda x, ids, g, w: cpu_quant.expert_ffn_q(x, ids, g, w, qt))
  return fn(x, ids, gates, {k: jnp.asarray(v) for k, v in w.items()})


@needs_kernel
@pytest.mark.parametrize("qgu,qdn", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_k", "q6_k"),
                                     ("q6_k", "q4_k"), ("q4_0", "q8_0")])
@pytest.mark.parametrize("n,fused", [(3, True), (40, False)])   # decode items, prompt blocks
def test_expert_ffn_q_matches_the_reference(qgu, qdn, n, fused):
  """Against the reference with the activations rounded as the kernel rounds them (within
  1e-3 of max|y|: a code that rounds the other way between f32 and float64), and against
  the exact experts (within 3% of max|y|: two 8-bit roundings in sequence)."""
  rng = np.random.default_rng(n)
  e, k = 5, 2
  d, inter = (96, 64) if qgu in ("q8_0", "q4_0") and qdn in ("q8_0", "q4_0") else (256, 256)
  w, qt = _experts(rng, qgu, qdn, e, d, inter, fused)
  x = rng.normal(size=(n, d)).astype(np.float32)
  ids = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
  gates = rng.random((n, k)).astype(np.float32)
  got = f32(_ffn(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(gates), w, qt))
  rounded = ref_experts(x, ids, gates, w, qt, rounded=True)
  exact = ref_experts(x, ids, gates, w, qt, rounded=False)
  np.testing.assert_allclose(got, rounded, rtol=0, atol=1e-3 * np.abs(rounded).max())
  np.testing.assert_allclose(got, exact, rtol=0, atol=3e-2 * np.abs(exact).max())


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_a_tokens_bits_are_the_same_alone_and_in_a_prompt(qtype):
  """Each token of a 41-, 42- and 43-token call equals, bit for bit, the same token alone
  (decode: 4-row tiles, 70 rows: a 2-row remainder), for the linear in f32 and bf16. The
  prompt: AVX-512's panels of 16 rows (4, then one of 6 padded) and 8 tokens (K-quants 4),
  then 1, 2 or 3; AVX2's tiles of 4 rows x 4 tokens, then a 1-, 2- or 3-token tile."""
  rng = np.random.default_rng(11)
  cols = 96 if BLOCK[qtype][0] == 32 else 512
  blocks = jnp.asarray(random_blocks(rng, qtype, 70, cols))
  fn = jax.jit(cpu_quant.linear_q, static_argnums=2)
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.normal(size=(43, cols)), dtype)
    alone = np.concatenate([np.asarray(fn(x[i:i + 1], blocks, qtype)) for i in range(43)])
    for n in (41, 42, 43):
      chex.assert_trees_all_equal(np.asarray(fn(x[:n], blocks, qtype)), alone[:n])


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [16, 17])
def test_panel_edges_keep_the_bits_and_the_values(qtype, rows):
  """A whole panel (16 rows) and one row more (a panel padded with 15 zero rows); calls of
  2 and 3 tokens (AVX-512: Q8_0 / Q4_0 panels from 2, the K-quants' tiles of 4 x 4 below
  their panels), 5 (a tile of 4, then 1), 6 (Q6_K's first panel) and 10 (Q4_K's): each
  token equals itself alone, bit for bit, and the reference within f32 rounding."""
  rng = np.random.default_rng(rows)
  cols = 96 if BLOCK[qtype][0] == 32 else 512
  raw = random_blocks(rng, qtype, rows, cols)
  blocks = jnp.asarray(raw)
  fn = jax.jit(cpu_quant.linear_q, static_argnums=2)
  x = jnp.asarray(rng.normal(size=(10, cols)), jnp.float32)
  alone = np.concatenate([np.asarray(fn(x[i:i + 1], blocks, qtype)) for i in range(10)])
  _, rounded = ref_linear(f32(x), raw, qtype)
  scale = np.abs(f32(x)) @ np.abs(dequantize(raw, qtype)).T
  assert np.all(np.abs(alone - rounded) <= 1e-5 * scale + 1e-5 * np.abs(rounded))
  for n in (2, 3, 5, 6, 10):
    chex.assert_trees_all_equal(np.asarray(fn(x[:n], blocks, qtype)), alone[:n])


@needs_kernel
@pytest.mark.parametrize("qgu,qdn", [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("q4_k", "q6_k"),
                                     ("q6_k", "q4_k")])
def test_expert_tokens_agree_between_decode_items_and_prompt_blocks(qgu, qdn):
  """Up to 16 tokens run in decode items (32 gate/up rows, then 64 down rows), more in
  one item per expert block; each token of a 41-token prompt equals the token alone, and
  the first 16 tokens of a 17-token call equal a 16-token call, bit for bit."""
  rng = np.random.default_rng(5)
  d, inter = (96, 96) if BLOCK[qgu][0] == BLOCK[qdn][0] == 32 else (256, 256)
  w, qt = _experts(rng, qgu, qdn, 6, d, inter, fused=True)
  x = jnp.asarray(rng.normal(size=(41, d)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.permutation(6)[:3] for _ in range(41)]), jnp.int32)
  g = jnp.asarray(rng.random((41, 3)), jnp.float32)
  prompt = np.asarray(_ffn(x, ids, g, w, qt))
  alone = np.concatenate([np.asarray(_ffn(x[i:i + 1], ids[i:i + 1], g[i:i + 1], w, qt))
                          for i in range(41)])
  chex.assert_trees_all_equal(prompt, alone)
  many, few = _ffn(x[:17], ids[:17], g[:17], w, qt), _ffn(x[:16], ids[:16], g[:16], w, qt)
  chex.assert_trees_all_equal(np.asarray(many[:16]), np.asarray(few))


@needs_kernel
@pytest.mark.parametrize("n", [2, 40])
def test_expert_pairs_with_gate_zero_are_not_computed(n):
  """A gate-0 pair's expert is never read (NaN scales there change nothing); all gates 0
  give zeros."""
  rng = np.random.default_rng(7)
  w, qt = _experts(rng, "q8_0", "q4_0", 4, 64, 32, fused=True)
  x = jnp.asarray(rng.normal(size=(n, 64)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 3, (n, 3)), jnp.int32).at[:, 1].set(3)
  gates = jnp.asarray(rng.random((n, 3)) + 0.1, jnp.float32).at[:, 1].set(0.0)
  nan = dict(w, gate_up=w["gate_up"].copy())
  nan["gate_up"][3].reshape(-1, 34)[:, :2] = np.float16(np.nan).reshape(1).view(np.uint8)
  got = _ffn(x, ids, gates, nan, qt)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_equal(got, _ffn(x, ids, gates, w, qt))
  chex.assert_trees_all_equal(_ffn(x, ids, jnp.zeros_like(gates), nan, qt), jnp.zeros_like(x))


@needs_kernel
def test_stacked_layers_are_read_in_place():
  """One layer of stacked blocks (layer_view.at inside a traced scan body) goes to the _at
  kernels, which read it where it lies: the same bits as the layer passed alone."""
  rng = np.random.default_rng(3)
  lin = jnp.asarray(np.stack([random_blocks(rng, "q4_k", 40, 256) for _ in range(3)]))
  ws = [_experts(rng, "q4_0", "q8_0", 4, 64, 32, fused=True)[0] for _ in range(3)]
  gu = jnp.asarray(np.stack([w["gate_up"] for w in ws]))
  dn = jnp.asarray(np.stack([w["down"] for w in ws]))
  qt = {"gate_up": "q4_0", "down": "q8_0"}
  x = jnp.asarray(rng.normal(size=(2, 256)), jnp.float32)
  xe = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32)
  ids, g = jnp.array([[0, 3], [2, 1]], jnp.int32), jnp.array([[0.5, 0.25], [1.0, 0.0]])

  def body(i):
    with layer_view.tracing():
      y = cpu_quant.linear_q(x, layer_view.at(lin, i), "q4_k")
      z = cpu_quant.expert_ffn_q(xe, ids, g, {"gate_up": layer_view.at(gu, i),
                                              "down": layer_view.at(dn, i)}, qt)
    return y, z

  fn = jax.jit(body)
  hlo = fn.lower(jnp.int32(1)).as_text()
  assert cpu_kernel.LINEAR_Q_AT_TARGET in hlo and cpu_kernel.EXPERT_FFN_Q_AT_TARGET in hlo
  for i in range(3):
    y, z = fn(jnp.int32(i))
    chex.assert_trees_all_equal(y, cpu_quant.linear_q(x, lin[i], "q4_k"))
    chex.assert_trees_all_equal(z, cpu_quant.expert_ffn_q(
        xe, ids, g, {"gate_up": gu[i], "down": dn[i]}, qt))


@needs_kernel
def test_vmap_folds_the_batch_into_the_rows():
  """vmap over x with shared blocks (the emulator's streams) is one kernel call over B*N
  rows and equals each element alone."""
  rng = np.random.default_rng(4)
  blocks = jnp.asarray(random_blocks(rng, "q6_k", 16, 256))
  w, qt = _experts(rng, "q4_k", "q4_k", 3, 256, 256, fused=False)
  xb = jnp.asarray(rng.normal(size=(3, 2, 256)), jnp.float32)
  ids = jnp.zeros((2, 2), jnp.int32).at[:, 1].set(2)
  g = jnp.full((2, 2), 0.5, jnp.float32)
  lin = jax.jit(jax.vmap(lambda x: cpu_quant.linear_q(x, blocks, "q6_k")))
  hlo = lin.lower(xb).as_text()
  assert cpu_kernel.LINEAR_Q_TARGET in hlo and "while" not in hlo
  ffn = jax.jit(jax.vmap(lambda x: _ffn(x, ids, g, w, qt)))
  for b in range(3):
    chex.assert_trees_all_equal(lin(xb)[b], cpu_quant.linear_q(xb[b], blocks, "q6_k"))
    chex.assert_trees_all_equal(ffn(xb)[b], _ffn(xb[b], ids, g, w, qt))


@pytest.mark.parametrize("qtype", TYPES)
def test_without_the_kernels_the_blocks_are_dequantized_in_the_program(qtype):
  """Other backends (here: the kernels switched off) dequantize the blocks and run XLA's
  ops: the exact dot of the dequantized weights, no custom call."""
  rng = np.random.default_rng(9)
  blocks = random_blocks(rng, qtype, 12, 512)
  w, qt = _experts(rng, qtype, qtype, 3, 256, 256, fused=True)
  x = rng.normal(size=(3, 512)).astype(np.float32)
  xe = rng.normal(size=(3, 256)).astype(np.float32)
  ids = np.array([[0, 2], [1, 1], [2, 0]], np.int32)
  g = rng.random((3, 2)).astype(np.float32)
  with cpu_kernel.enabled(False):
    fn = jax.jit(lambda x, b: cpu_quant.linear_q(x, b, qtype))
    assert "custom_call" not in fn.lower(x, blocks).as_text()
    y = fn(x, blocks)
    z = jax.jit(lambda x: cpu_quant.expert_ffn_q(x, ids, g, {k: jnp.asarray(v) for k, v in
                                                              w.items()}, qt))(xe)
  np.testing.assert_allclose(f32(y), ref_linear(x, blocks, qtype)[0], rtol=1e-4, atol=1e-4)
  want = ref_experts(xe, ids, g, w, qt, rounded=False)
  np.testing.assert_allclose(f32(z), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_quant_arrays_and_qtype_names_are_accepted():
  """A QuantArray-like object (.blocks, .qtype) stands for blocks and qtype; names in any
  case and gguf-style enums are understood; a wrong size is refused."""
  class QA:
    def __init__(self, blocks, qtype):
      self.blocks, self.qtype = blocks, qtype

  class Enum:
    name = "Q4_K"

  rng = np.random.default_rng(6)
  blocks = jnp.asarray(random_blocks(rng, "q4_k", 8, 256))
  x = jnp.asarray(rng.normal(size=(2, 256)), jnp.float32)
  want = cpu_quant.linear_q(x, blocks, "q4_k")
  chex.assert_trees_all_equal(cpu_quant.linear_q(x, QA(blocks, Enum())), want)
  chex.assert_trees_all_equal(cpu_quant.linear_q(x, blocks, "Q4_K"), want)
  with pytest.raises(ValueError, match="q8_0"):
    cpu_quant.qtype_name("q5_k")
  with pytest.raises(ValueError, match="rows of 512"):
    cpu_quant.linear_q(jnp.zeros((1, 512)), blocks, "q4_k")


@needs_kernel
def test_isa_names_the_dots_this_build_runs():
  """isa() (a benchmark's record) agrees with the build's lane count: AVX-512 dots come
  with 16 lanes; "off" without the kernels."""
  assert cpu_quant.isa() in ("avx512-vnni", "avx2", "scalar")
  if cpu_quant.isa() == "avx512-vnni":
    assert cpu_kernel.lanes() == 16
  with cpu_kernel.enabled(False):
    assert cpu_quant.isa() == "off"


@needs_kernel
def test_the_model_path_reaches_the_kernels_through_quant_arrays():
  """moejax.model.quant_ops calls cpu_quant.quant_linears / quant_expert_ffn: with
  QuantArrays of the four types they give the kernels' results (one custom call); a type
  the kernels lack, or a plain weight among them, gives None (XLA's path)."""
  qarray = pytest.importorskip("moejax.ggml.qarray", reason="no QuantArray in this tree")
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(3, 256)), jnp.bfloat16)
  blocks = {q: jnp.asarray(random_blocks(rng, q, 32, 256)) for q in TYPES}
  qas = tuple(qarray.QuantArray(b, q) for q, b in blocks.items())
  fn = jax.jit(lambda x, ws: cpu_quant.quant_linears(x, ws))
  assert fn.lower(x, qas).as_text().count(cpu_kernel.LINEAR_Q_TARGET) == 1
  for y, (q, b) in zip(fn(x, qas), blocks.items()):
    chex.assert_trees_all_equal(y, cpu_quant.linear_q(x, b, q))
  assert cpu_quant.quant_linears(x, (qas[0], jnp.zeros((4, 256), jnp.bfloat16))) is None
  w, qt = _experts(rng, "q4_k", "q6_k", 3, 256, 256, fused=True)
  qw = {k: qarray.QuantArray(jnp.asarray(v), qt[k]) for k, v in w.items()}
  ids, g = jnp.array([[0, 2]] * 3, jnp.int32), jnp.full((3, 2), 0.5, jnp.float32)
  chex.assert_trees_all_equal(cpu_quant.quant_expert_ffn(x, ids, g, qw),
                              _ffn(x, ids, g, w, qt))
  q5 = type("QA", (), {"blocks": blocks["q8_0"], "qtype": "q5_0"})()
  assert cpu_quant.quant_linears(x, (q5,)) is None
  assert cpu_quant.quant_expert_ffn(x, ids, g, dict(qw, down=q5)) is None
