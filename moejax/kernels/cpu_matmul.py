"""The float weights' matmuls on the CPU kernels (``cpu_kernel.cc``): the routed-expert FFN
and the decode-time linears; ``cpu_quant`` is the same for ggml blocks.

XLA CPU copies each dynamically selected expert's weights before its dot (a loop fusion
per slice), runs a decode token's matvecs on one core, and converts bf16 weights to f32
before each dot.  The kernel reads the selected experts in place, sorts a prompt's
(token, expert) pairs by expert into blocks, and shares the blocks with XLA's intra-op
thread pool; ``linear`` does the same for a projection of a few rows (decode), bf16 weights
read as bf16.  Each function asks ``cpu_kernel.available()`` (the library and its switch);
elsewhere XLA's form runs.

Gradients go through XLA's grouped dispatch (``custom_vjp``), so training is unchanged;
under ``vmap`` with shared weights (the emulator's streams) the batch is folded into the
rows of one kernel call; with batched weights it runs once per batch element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.kernels import cpu_kernel
from moejax.kernels import layer_view

LINEAR_MAX_TOKENS = 16   # up to this many rows of x: the kernel (decode); more: XLA's GEMM
# bf16: XLA's GEMM converts the whole weight to f32 at every call (~9 ms for 4096 x 2048),
# so the kernel stays ahead longer: 4096 x 2048 bf16 at 32 / 64 / 128 rows, kernel 3.6 /
# 6.7 / 14.3 ms against XLA's 11.8 / 10.7 / 15.1 (AVX512-BF16 EPYC; AVX2: 6.4 against
# 12.1 at 64, 28 against 19 at 256)
LINEAR_MAX_TOKENS_BF16 = 64
# ... and where the kernels' dots are 16 lanes wide (AVX-512), the longest prompt bucket:
# 4096 x 2048 bf16 at 128 / 512 / 1024 / 2048 rows, 6.1 / 24-28 / 46 / 125-147 ms against
# XLA's 13-14 / 27-30 / 48 / 87-92; with bf16 pairs (AVX512-BF16) 13.6 ms at 512
# (docs/lab/runs/2026-12-06-avx512)
LINEAR_MAX_TOKENS_BF16_WIDE = 512
# f32 projections with fewer weight bytes stay with XLA: its dot is as fast there, and the
# custom call's fixed cost (argument marshalling, waking the thread pool) is not paid per
# projection (docs/lab/notes/cpu_speed.md, "Which projections go to the kernel").  bf16 always
# goes to the kernel: XLA converts the weights to f32 before each dot.
LINEAR_MIN_F32_BYTES = 1 << 20


def supports(x_NxD, w: dict) -> bool:
  """Plain SwiGLU experts in f32 or bf16 (also bf16 held as uint16 bits, as the engine's
  program store holds them) and an f32/bf16 activation."""
  ok = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
  return (set(w) == {"gate_up", "down"} and jnp.dtype(x_NxD.dtype) in ok
          and jnp.dtype(w["gate_up"].dtype) in ok | {jnp.dtype(jnp.uint16)}
          and w["gate_up"].dtype == w["down"].dtype)


def _bits_as_bf16(w):
  """uint16 bf16 bits as bf16 (the XLA fallback's view of a program store)."""
  return jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == jnp.uint16 else w


def _expert_call(x_NxD, ids_NxK, gates_NxK, gate_up_Ex2IxD, down_ExDxI):
  return jax.ffi.ffi_call(cpu_kernel.TARGET, jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype))(
      x_NxD, ids_NxK.astype(jnp.int32), gates_NxK.astype(jnp.float32), gate_up_Ex2IxD,
      down_ExDxI)


_call = cpu_kernel.rows_vmap(_expert_call, 3)


def expert_ffn(x_NxD, ids_NxK, gates_NxK, w: dict, xla_fn):
  """sum_k gates[n,k] * expert_{ids[n,k]}(x[n]) on CPU: the kernel; elsewhere `xla_fn`.

  `xla_fn(x, ids, gates, w)` is the XLA dispatch: other platforms run it, and the
  backward pass differentiates it.  Weights that are one layer of stacked ones
  (`layer_view.at`) are read there in place (forward only: the engine's scan).
  """
  v = layer_view.common([w["gate_up"], w["down"]])
  if v is not None:
    return cpu_kernel.experts_at(
        cpu_kernel.TARGET_AT, x_NxD, ids_NxK, gates_NxK, *v,
        lambda x, ids, g: xla_fn(x, ids, g, {k: _bits_as_bf16(a) for k, a in w.items()}))
  return _expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _expert_ffn(x_NxD, ids_NxK, gates_NxK, w: dict, xla_fn):
  return jax.lax.platform_dependent(
      x_NxD, ids_NxK, gates_NxK, w["gate_up"], w["down"],
      cpu=_call,
      default=lambda x, i, g, gu, dn: xla_fn(x, i, g, {"gate_up": _bits_as_bf16(gu),
                                                       "down": _bits_as_bf16(dn)}))


def _fwd(x_NxD, ids_NxK, gates_NxK, w, xla_fn):
  return _expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_fn), (x_NxD, ids_NxK, gates_NxK, w)


def _bwd(xla_fn, res, g_NxD):
  x_NxD, ids_NxK, gates_NxK, w = res
  _, vjp = jax.vjp(lambda x, g, ww: xla_fn(x, ids_NxK, g, ww), x_NxD, gates_NxK, w)
  dx, dg, dw = vjp(g_NxD)
  return dx, None, dg, dw


_expert_ffn.defvjp(_fwd, _bwd)


def _linears_ffi(x_NxD, *ws_OxD):
  return tuple(jax.ffi.ffi_call(cpu_kernel.LINEAR_TARGET, tuple(
      jax.ShapeDtypeStruct((x_NxD.shape[0], w.shape[0]), x_NxD.dtype) for w in ws_OxD))(
          x_NxD, *ws_OxD))


_linears_call = cpu_kernel.rows_vmap(_linears_ffi, 1)


def _einsums(x_NxD, *ws_OxD):
  return tuple(jnp.einsum("nd,od->no", x_NxD, w) for w in ws_OxD)


@jax.custom_vjp
def _linears_kernel(x_NxD, ws_OxD):
  return jax.lax.platform_dependent(x_NxD, *ws_OxD, cpu=_linears_call, default=_einsums)


def _linears_fwd(x_NxD, ws_OxD):
  return _linears_kernel(x_NxD, ws_OxD), (x_NxD, ws_OxD)


def _linears_bwd(res, gs_NxO):
  x_NxD, ws_OxD = res
  dx, *dws = jax.vjp(_einsums, x_NxD, *ws_OxD)[1](tuple(gs_NxO))
  return dx, tuple(dws)


_linears_kernel.defvjp(_linears_fwd, _linears_bwd)


def linears(x_NxD, ws_OxD) -> tuple:
  """(x @ w.T for w in ws_OxD): one kernel call on CPU for a few rows when x and every
  weight share an f32/bf16 dtype (f32 only when the weights hold at least
  LINEAR_MIN_F32_BYTES together), else an einsum each. Projections of the same input
  (q/k/v) go in one call: one dispatch and one wake-up of the pool for all of them.
  Weights that are one layer of stacked ones (`layer_view.at`) are read there in place."""
  ws_OxD = tuple(ws_OxD)
  ok = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
  dt = jnp.dtype(x_NxD.dtype)
  small_f32 = dt == jnp.float32 and sum(w.size * 4 for w in ws_OxD) < LINEAR_MIN_F32_BYTES
  wide = cpu_kernel.lanes() == 16
  most = ((LINEAR_MAX_TOKENS_BF16_WIDE if wide else LINEAR_MAX_TOKENS_BF16)
          if dt == jnp.bfloat16 else LINEAR_MAX_TOKENS)
  if (x_NxD.shape[0] <= most and dt in ok and not small_f32
      and all(jnp.dtype(w.dtype) == dt for w in ws_OxD) and cpu_kernel.available()):
    v = layer_view.common(ws_OxD)
    if v is not None:   # one layer of stacked weights, read in place (forward only)
      stacks, i = v
      at = lambda x, i, *ws: tuple(jax.ffi.ffi_call(cpu_kernel.LINEAR_AT_TARGET, tuple(
          jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype) for w in ws))(
              i.astype(jnp.int32), x, *ws))
      return jax.lax.platform_dependent(x_NxD, i, *stacks, cpu=at,
                                        default=lambda x, *_: _einsums(x, *ws_OxD))
    return _linears_kernel(x_NxD, ws_OxD)
  return _einsums(x_NxD, *ws_OxD)


def linear(x_NxD, w_OxD):
  """x @ w.T: `linears` with one weight."""
  return linears(x_NxD, (w_OxD,))[0]
