"""Linear layers and routed experts on GGUF quantized weights (Q8_0, Q4_0, Q4_K, Q6_K),
computed on the blocks by the C++ CPU kernels (``cpu_quant.cc``), as llama.cpp computes
them: each token's row quantized to 8 bits once per call (blocks of 32 for Q8_0/Q4_0, of
256 for the K-quants), integer dots per block (AVX512-VNNI, else AVX2), f32 accumulation.

A quantized weight [O, C] is GGUF's raw block bytes, row-major: a uint8 array
[O, C / bs * type_size] (bs 32 and 34 / 18 bytes for Q8_0 / Q4_0; bs 256 and 144 / 210
bytes for Q4_K / Q6_K). A wrapper takes the array and its qtype name, or any object with
``.blocks`` and ``.qtype`` (a QuantArray).

Accuracy: the activation's 8-bit rounding bounds the error against the exact dot of the
dequantized weights: per block of the token, |error| <= 0.5 * d_x * sum |w| with d_x =
max|x| / 127 of that block, i.e. at most max|x_block| / 254 * sum |w_block| (tests hold
the kernels to it). A token's result has the same bits alone or in a prompt.

Elsewhere (another backend, or no kernels) the weights are dequantized in the program
(``dequantize``) and XLA's ops run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel
from moejax.kernels import layer_view

# name -> (number in the kernels, elements a block, bytes a block)
QTYPES = {"q8_0": (0, 32, 34), "q4_0": (1, 32, 18), "q4_k": (2, 256, 144),
          "q6_k": (3, 256, 210)}


def isa() -> str:
  """The instructions the quantized dots use here, for a benchmark's record:
  "avx512-vnni", "avx2" or "scalar"; "off" where the kernels are not used."""
  if not cpu_kernel.available():
    return "off"
  return cpu_kernel._state["lib"].moejax_qdot_isa().decode()


def qtype_name(qtype) -> str:
  """'q8_0', 'q4_0', 'q4_k' or 'q6_k' from a name in any case, or an enum whose name is
  one (gguf's GGMLQuantizationType.Q4_K)."""
  name = str(getattr(qtype, "name", qtype)).split(".")[-1].lower()
  if name not in QTYPES:
    raise ValueError(f"unsupported quantized type {qtype!r} (one of {sorted(QTYPES)})")
  return name


def blocks_of(w, qtype=None):
  """(uint8 blocks, qtype name) of `w`: a QuantArray-like object (``.blocks``, ``.qtype``)
  or a uint8 array with its `qtype`."""
  if hasattr(w, "blocks") and hasattr(w, "qtype"):
    return w.blocks, qtype_name(w.qtype)
  if qtype is None:
    raise ValueError("a uint8 block array needs its qtype")
  return w, qtype_name(qtype)


def row_elems(blocks_OxB, qtype) -> int:
  """C, the elements of a row of `blocks_OxB` (its last axis is C / bs * type_size)."""
  _, bs, size = QTYPES[qtype_name(qtype)]
  if blocks_OxB.shape[-1] % size:
    raise ValueError(f"{qtype}: a row of {blocks_OxB.shape[-1]} bytes is not whole blocks")
  return blocks_OxB.shape[-1] // size * bs


def _halves(b, start):
  """The f16 at bytes start, start + 1 of each block, as f32."""
  return jax.lax.bitcast_convert_type(b[..., start:start + 2], jnp.float16).astype(jnp.float32)


def _dequant_blocks(b, name):
  """Blocks [..., nb, size] -> values [..., nb, bs] (f32), as ggml's dequantize_row_*."""
  i8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.int8).astype(jnp.int32)
  u = lambda a: a.astype(jnp.int32)
  if name == "q8_0":
    return _halves(b, 0)[..., None] * i8(b[..., 2:]).astype(jnp.float32)
  if name == "q4_0":
    qs = u(b[..., 2:])
    q = jnp.concatenate([qs & 15, qs >> 4], axis=-1) - 8
    return _halves(b, 0)[..., None] * q.astype(jnp.float32)
  if name == "q4_k":
    s = u(b[..., 4:16])
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = jnp.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    qs = u(b[..., 16:]).reshape(b.shape[:-1] + (4, 1, 32))
    q = ((qs >> jnp.array([0, 4]).reshape(2, 1)) & 15).reshape(b.shape[:-1] + (8, 32))
    val = (_halves(b, 0)[..., None] * sc)[..., None] * q - (_halves(b, 2)[..., None] * mn)[..., None]
    return val.reshape(b.shape[:-1] + (256,))
  ql = u(b[..., :128]).reshape(b.shape[:-1] + (2, 1, 64))                 # q6_k
  lo = ((ql >> jnp.array([0, 4]).reshape(2, 1)) & 15).reshape(b.shape[:-1] + (2, 128))
  qh = u(b[..., 128:192]).reshape(b.shape[:-1] + (2, 1, 32))
  hi = ((qh >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 3).reshape(b.shape[:-1] + (2, 128))
  q = (lo | (hi << 4)).reshape(b.shape[:-1] + (16, 16)) - 32
  sc = i8(b[..., 192:208]).astype(jnp.float32)
  return ((_halves(b, 208)[..., None] * sc)[..., None] * q).reshape(b.shape[:-1] + (256,))


def dequantize(blocks_OxB, qtype, dtype=jnp.float32):
  """The weight [..., O, C] the blocks hold, in `dtype` (other backends' path)."""
  name = qtype_name(qtype)
  _, bs, size = QTYPES[name]
  b = blocks_OxB.reshape(blocks_OxB.shape[:-1] + (blocks_OxB.shape[-1] // size, size))
  vals = _dequant_blocks(b, name)
  return vals.reshape(blocks_OxB.shape[:-1] + (-1,)).astype(dtype)


def _dense(x_NxC, ws):
  """x @ dequantize(w).T for each (blocks, name), in x's dtype (f32 products)."""
  xf = x_NxC.astype(jnp.float32)
  return tuple((xf @ dequantize(b, q).T).astype(x_NxC.dtype) for b, q in ws)


def _codes(names):
  """The kernels' numbers of the qtypes, as the int32 array attribute they take."""
  return np.asarray([QTYPES[n][0] for n in names], np.int32)


def _linears_ffi(names):
  codes = _codes(names)

  def call(x_NxC, *bs):
    outs = tuple(jax.ShapeDtypeStruct((x_NxC.shape[0], b.shape[0]), x_NxC.dtype) for b in bs)
    return tuple(jax.ffi.ffi_call(cpu_kernel.LINEAR_Q_TARGET, outs)(x_NxC, *bs,
                                                                   qtypes=codes))
  return cpu_kernel.rows_vmap(call, 1)


def linears_q(x_NxC, ws, xla_fn=None) -> tuple:
  """(x @ dequant(w).T for w in ws), one kernel call on CPU for every weight of the same
  input (q/k/v). Each w is a QuantArray-like object or a (uint8 blocks [O, B], qtype)
  pair; x is f32 or bf16 and so are the results. One layer of stacked blocks
  (`layer_view.at`) is read where it lies. Elsewhere `xla_fn(x, ws)` runs if given, else
  the blocks dequantized in the program."""
  orig = tuple(ws)
  ws = tuple(blocks_of(*w) if isinstance(w, tuple) else blocks_of(w) for w in orig)
  for b, q in ws:
    if row_elems(b, q) != x_NxC.shape[-1] or b.dtype != jnp.uint8:
      raise ValueError(f"{q} blocks {b.shape} {b.dtype} do not hold rows of {x_NxC.shape[-1]}")
  names = tuple(q for _, q in ws)
  if not cpu_kernel.available():
    return _dense(x_NxC, ws)
  dense = lambda x, *_: tuple(xla_fn(x, orig)) if xla_fn is not None else _dense(x, ws)
  v = layer_view.common([b for b, _ in ws])
  if v is not None:   # one layer of stacked blocks, read in place
    stacks, i = v
    codes = _codes(names)
    at = lambda x, i, *bs: tuple(jax.ffi.ffi_call(cpu_kernel.LINEAR_Q_AT_TARGET, tuple(
        jax.ShapeDtypeStruct((x.shape[0], b.shape[1]), x.dtype) for b in bs))(
            i.astype(jnp.int32), x, *bs, qtypes=codes))
    return jax.lax.platform_dependent(x_NxC, i, *stacks, cpu=at, default=dense)
  return jax.lax.platform_dependent(x_NxC, *(b for b, _ in ws), cpu=_linears_ffi(names),
                                    default=dense)


def linear_q(x_NxC, blocks_OxB, qtype=None):
  """x @ dequant(w).T: `linears_q` with one weight (blocks and qtype, or a QuantArray)."""
  return linears_q(x_NxC, ((blocks_OxB, qtype),) if qtype is not None else (blocks_OxB,))[0]


def _dense_experts(x_NxD, ids_NxK, gates_NxK, deq):
  """The routed SwiGLU FFN on dequantized experts (other backends' path): the selected
  experts' rows gathered, f32 products, x's dtype."""
  xf = x_NxD.astype(jnp.float32)
  gate, up = (deq["gate"], deq["up"]) if "gate" in deq else jnp.split(deq["gate_up"], 2, axis=1)
  g = jnp.einsum("nd,nkid->nki", xf, gate[ids_NxK])
  u = jnp.einsum("nd,nkid->nki", xf, up[ids_NxK])
  y = jnp.einsum("nki,nkdi->nkd", jax.nn.silu(g) * u, deq["down"][ids_NxK])
  return jnp.einsum("nkd,nk->nd", y, gates_NxK.astype(jnp.float32)).astype(x_NxD.dtype)


def _experts_ffi(target, qgu, qdn, x_at=0):
  """The kernel call on (..., x, ids, gates, *blocks), x the argument at `x_at`."""
  def call(*args):
    out = jax.ShapeDtypeStruct(args[x_at].shape, args[x_at].dtype)
    return jax.ffi.ffi_call(target, out)(*args, qtype_gu=np.int32(QTYPES[qgu][0]),
                                         qtype_down=np.int32(QTYPES[qdn][0]))
  return call


def expert_ffn_q(x_NxD, ids_NxK, gates_NxK, w: dict, qtypes: dict | None = None,
                 xla_fn=None):
  """sum_k gates[n, k] * expert_{ids[n, k]}(x[n]) (SwiGLU) on quantized experts.

  `w` holds "gate_up" [E, 2I, Bd] (an expert's gate rows, then its up rows) or "gate"
  and "up" [E, I, Bd], and "down" [E, D, Bi]: each uint8 blocks (its qtype in
  `qtypes[key]`) or a QuantArray-like object. gate and up share a qtype; down may have
  another (Q4_K_M files: Q4_K gate/up, Q6_K down). Pairs whose gate is 0 are not computed.
  One layer of stacked blocks (`layer_view.at`) is read where it lies. Elsewhere
  `xla_fn(x, ids, gates, w)` runs if given, else the experts dequantized in the program.
  """
  qtypes = qtypes or {}
  keys = ("gate_up", "down") if "gate_up" in w else ("gate", "up", "down")
  if set(w) != set(keys):
    raise ValueError(f"quantized experts take gate_up/down or gate/up/down, not {sorted(w)}")
  bq = {k: blocks_of(w[k], qtypes.get(k)) for k in keys}
  qgu, qdn = bq[keys[0]][1], bq["down"][1]
  if bq[keys[-2]][1] != qgu:
    raise ValueError(f"gate and up have different qtypes ({qgu}, {bq[keys[-2]][1]})")
  blocks = [bq[k][0] for k in keys]
  if row_elems(blocks[0], qgu) != x_NxD.shape[-1]:
    raise ValueError(f"{qgu} gate/up blocks {blocks[0].shape} do not hold rows of "
                     f"{x_NxD.shape[-1]}")
  dense = lambda x, ids, g, *_: (xla_fn(x, ids, g, w) if xla_fn is not None else _dense_experts(
      x, ids, g, {k: dequantize(b, q) for k, (b, q) in bq.items()}))
  if not cpu_kernel.available():
    return dense(x_NxD, ids_NxK, gates_NxK)
  ids, gates = ids_NxK.astype(jnp.int32), gates_NxK.astype(jnp.float32)
  v = layer_view.common(blocks)
  if v is not None:   # one layer of stacked blocks, read in place
    stacks, i = v
    at = _experts_ffi(cpu_kernel.EXPERT_FFN_Q_AT_TARGET, qgu, qdn, x_at=1)
    return jax.lax.platform_dependent(
        x_NxD, ids, gates, i, *stacks, default=lambda x, ids, g, *_: dense(x, ids, g),
        cpu=lambda x, ids, g, i, *bs: at(i.astype(jnp.int32), x, ids, g, *bs))
  call = cpu_kernel.rows_vmap(_experts_ffi(cpu_kernel.EXPERT_FFN_Q_TARGET, qgu, qdn), 3)
  return jax.lax.platform_dependent(x_NxD, ids, gates, *blocks, cpu=call, default=dense)


def _takes(w) -> bool:
  """Whether the kernels take `w`: a QuantArray-like object of a type they compute."""
  return (hasattr(w, "blocks") and hasattr(w, "qtype")
          and str(getattr(w.qtype, "name", w.qtype)).split(".")[-1].lower() in QTYPES)


def quant_linears(x_NxD, ws_OxD, xla_fn=None):
  """`linears_q` for the model's weights (`moejax.model.quant_ops.linears`): None where the
  kernels do not take them (a plain weight or a type they lack among them, x not f32/bf16,
  or no kernels)."""
  ws_OxD = tuple(ws_OxD)
  if (not cpu_kernel.available() or not all(_takes(w) for w in ws_OxD)
      or jnp.dtype(x_NxD.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))):
    return None
  return linears_q(x_NxD, ws_OxD, xla_fn)


def quant_expert_ffn(x_NxD, ids_NxK, gates_NxK, w: dict, xla_fn=None):
  """`expert_ffn_q` for the model's experts (QuantArrays under "gate_up"/"down" or
  "gate"/"up"/"down"); None where the kernels do not take them."""
  keys = {"gate_up", "down"} if "gate_up" in w else {"gate", "up", "down"}
  if (not cpu_kernel.available() or set(w) != keys or not all(_takes(v) for v in w.values())
      or jnp.dtype(x_NxD.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))):
    return None
  gu = [qtype_name(w[k].qtype) for k in sorted(keys - {"down"})]
  gate = w["gate_up"] if "gate_up" in w else w["gate"]
  if (len(set(gu)) != 1 or gate.blocks.shape[-1] % QTYPES[gu[0]][2]
      or row_elems(gate.blocks, gu[0]) != x_NxD.shape[-1]
      or w["down"].blocks.shape[-1] % QTYPES[qtype_name(w["down"].qtype)][2]):
    return None
  return expert_ffn_q(x_NxD, ids_NxK, gates_NxK, w, xla_fn=xla_fn)
