"""The routed-expert FFN and decode-time matvecs as a small C++ kernel on XLA's CPU
backend (through jax.ffi).

XLA CPU copies each dynamically selected expert's weights before its dot (a loop fusion
per slice), runs a decode token's matvecs on one core, and converts bf16 weights to f32
before each dot. ``cpu_kernel.cc`` reads
the selected experts in place, sorts a prompt's (token, expert) pairs by expert into
blocks, and shares the blocks with XLA's intra-op thread pool; ``linear`` does the same
for a projection of a few rows (decode), bf16 weights read as bf16. It is compiled with the
system C++ compiler on first use into a cache keyed by the sources, flags, compiler and
instruction set (``cpu_build``).

``available()`` is the one switch every caller asks. ``MOEJAX_CPU_KERNEL``: unset or
``1`` (any value but the ones below): the kernels on JAX's CPU backend, built on first
use; ``0``, ``off``, ``false`` or ``no``: never built nor used. On any other default
backend (a GPU host) they are never built nor loaded and XLA's ops run everywhere.
Without a compiler, or when the build fails, one line on stderr says so (once per
process) and XLA's ops run.

The decode helper threads spin between calls only inside ``decoding()`` (the decode
loops of the Sampler, the OffloadEngine and the benchmarks enter it); elsewhere they
sleep right after each job.

Gradients go through XLA's grouped dispatch (``custom_vjp``), so training is unchanged;
under ``vmap`` with shared weights (the emulator's streams) the batch is folded into the
rows of one kernel call; with batched weights it runs once per batch element.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading

import jax
import jax.numpy as jnp

from moejax.kernels import cpu_build
from moejax.kernels import layer_view

TARGET = "moejax_expert_ffn"
LINEAR_TARGET = "moejax_linear"
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
ATTENTION_TARGET = "moejax_decode_attention"     # cpu_attention.cc, wrapped by cpu_attention.py
RMS_NORM_TARGET = "moejax_rms_norm"              # cpu_rows.cc, wrapped by cpu_rows.py
ROUTE_SOFTMAX_TARGET = "moejax_route_softmax"    # cpu_rows.cc, wrapped by cpu_rows.py
TAKE_ROWS_TARGET = "moejax_take_rows"            # cpu_rows.cc, wrapped by cpu_rows.py
WRITE_ROWS_TARGET = "moejax_write_rows"          # cpu_rows.cc, wrapped by cpu_rows.py
COPY_ROWS_TARGET = "moejax_copy_rows"            # cpu_rows.cc, wrapped by cpu_rows.py
WILL_NEED_TARGET = "moejax_will_need"            # cpu_rows.cc, wrapped by cpu_rows.py
TOP_K_TARGET = "moejax_top_k"                    # cpu_rows.cc, wrapped by cpu_rows.py
BIN_SUM_TARGET = "moejax_bin_sum"                # cpu_rows.cc, wrapped by cpu_rows.py
HOST_EXPERTS_TARGET = "moejax_host_experts"      # cpu_host.cc, wrapped by cpu_host.py
# the same kernels reading one layer of stacked [L, ...] operands (cpu_layer.h), the layer
# an int32 scalar operand: the engine's layers as one scan (`layer_view`)
LINEAR_AT_TARGET = "moejax_linear_at"
TARGET_AT = "moejax_expert_ffn_at"
ATTENTION_AT_TARGET = "moejax_decode_attention_at"
HOST_EXPERTS_AT_TARGET = "moejax_host_experts_at"
# GGUF quantized weights (cpu_quant.cc, wrapped by cpu_quant.py)
LINEAR_Q_TARGET = "moejax_linear_q"
LINEAR_Q_AT_TARGET = "moejax_linear_q_at"
EXPERT_FFN_Q_TARGET = "moejax_expert_ffn_q"
EXPERT_FFN_Q_AT_TARGET = "moejax_expert_ffn_q_at"
_OFF = ("0", "off", "false", "no")   # MOEJAX_CPU_KERNEL values that switch the kernels off
_lock = threading.Lock()
# loaded: None (not tried), True or False; override: enabled()'s choice, None: the env;
# decoding: depth of nested decoding() contexts
_state = {"loaded": None, "override": None, "lib": None, "decoding": 0}


def _load() -> bool:
  """Builds, loads and registers the kernels; False (after one line on stderr) when
  anything fails."""
  try:
    lib = ctypes.cdll.LoadLibrary(cpu_build.build())
    for target, symbol in ((TARGET, lib.MoejaxExpertFfn),
                           (LINEAR_TARGET, lib.MoejaxLinear),
                           (ATTENTION_TARGET, lib.MoejaxDecodeAttention),
                           (RMS_NORM_TARGET, lib.MoejaxRmsNorm),
                           (ROUTE_SOFTMAX_TARGET, lib.MoejaxRouteSoftmax),
                           (TAKE_ROWS_TARGET, lib.MoejaxTakeRows),
                           (WRITE_ROWS_TARGET, lib.MoejaxWriteRows),
                           (COPY_ROWS_TARGET, lib.MoejaxCopyRows),
                           (WILL_NEED_TARGET, lib.MoejaxWillNeed),
                           (TOP_K_TARGET, lib.MoejaxTopK),
                           (BIN_SUM_TARGET, lib.MoejaxBinSum),
                           (HOST_EXPERTS_TARGET, lib.MoejaxHostExperts),
                           (LINEAR_AT_TARGET, lib.MoejaxLinearAt),
                           (TARGET_AT, lib.MoejaxExpertFfnAt),
                           (ATTENTION_AT_TARGET, lib.MoejaxDecodeAttentionAt),
                           (HOST_EXPERTS_AT_TARGET, lib.MoejaxHostExpertsAt),
                           (LINEAR_Q_TARGET, lib.MoejaxLinearQ),
                           (LINEAR_Q_AT_TARGET, lib.MoejaxLinearQAt),
                           (EXPERT_FFN_Q_TARGET, lib.MoejaxExpertFfnQ),
                           (EXPERT_FFN_Q_AT_TARGET, lib.MoejaxExpertFfnQAt)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    lib.moejax_set_spin_us.argtypes = [ctypes.c_int64]
    lib.moejax_set_decoding.argtypes = [ctypes.c_int]
    lib.moejax_decoding.restype = ctypes.c_int
    lib.moejax_lanes.restype = ctypes.c_int
    lib.moejax_pairs.restype = ctypes.c_int
    lib.moejax_qdot_isa.restype = ctypes.c_char_p
    lib.moejax_set_decoding(int(_state["decoding"] > 0))
    _state["lib"] = lib
    return True
  except Exception as e:  # pylint: disable=broad-except  # any failure: XLA's ops
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    print(f"[moejax] CPU kernels not built ({why}); using XLA's ops", file=sys.stderr)
    return False


def available() -> bool:
  """Whether the CPU kernels are used in what is traced now: the one switch every caller
  asks. Off with MOEJAX_CPU_KERNEL=0/off/false/no (or inside ``enabled(False)``), and
  whenever JAX's default backend is not the CPU (nothing is built or loaded there);
  else builds and loads them on the first call, False if that fails."""
  on = _state["override"]
  if on is None:
    on = os.environ.get("MOEJAX_CPU_KERNEL", "1").strip().lower() not in _OFF
  if not on or jax.default_backend() != "cpu":
    return False
  with _lock:
    if _state["loaded"] is None:
      _state["loaded"] = _load()
    return _state["loaded"]


def lanes() -> int:
  """The kernels' dot products' vector width in f32 lanes: 16 where they were built for
  AVX-512, 8 otherwise; 0 when the kernels are not used."""
  return int(_state["lib"].moejax_lanes()) if available() else 0


def describe() -> str:
  """What the CPU kernels' dots are here, for a benchmark's record (figures differ by
  instruction set): e.g. "16-lane dots, bf16 pairs", or "off" where the kernels are not
  used."""
  if not available():
    return "off"
  pairs = ", bf16 pairs" if _state["lib"].moejax_pairs() else ""
  return f"{lanes()}-lane dots{pairs}"


def set_spin_us(us: int) -> bool:
  """How long the kernel's decode helper threads stay awake after a call inside
  ``decoding()``, in microseconds (default 1000, or $MOEJAX_CPU_SPIN_US at start-up). A
  decode step's calls are 0.1-1 ms apart, so an awake helper joins each at once; 0 hands
  decode calls to XLA's intra-op pool instead, whose task woke 100-600 us late on a
  2-core machine (docs/lab/notes/cpu_speed.md). Returns False (and does nothing) when the kernel is
  unavailable."""
  if not available():
    return False
  _state["lib"].moejax_set_spin_us(int(us))
  return True


@contextlib.contextmanager
def decoding():
  """Marks a running decode loop: inside, the kernel's decode helper threads stay awake
  for the spin time after each job (so the next call of the step, or the next step,
  finds them awake); outside they sleep right after it. Nests; wrap the whole loop,
  until its last result is on the host (dispatch is asynchronous). Builds nothing: a
  no-op until the kernels are loaded (they take the flag when they are)."""
  with _lock:
    _state["decoding"] += 1
    if _state["lib"] is not None:
      _state["lib"].moejax_set_decoding(1)
  try:
    yield
  finally:
    with _lock:
      _state["decoding"] -= 1
      if _state["lib"] is not None and _state["decoding"] == 0:
        _state["lib"].moejax_set_decoding(0)


def is_decoding() -> bool:
  """The helpers' flag as the loaded library holds it (False when not loaded)."""
  return _state["lib"] is not None and bool(_state["lib"].moejax_decoding())


@contextlib.contextmanager
def enabled(on: bool):
  """Functions *traced* inside use (or not) the kernel, whatever MOEJAX_CPU_KERNEL says;
  compiled ones keep their choice."""
  prev = _state["override"]
  _state["override"] = on
  try:
    yield
  finally:
    _state["override"] = prev


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


def rows_vmap(fn, n_rows_args: int):
  """`fn` with a vmap rule for kernels whose first `n_rows_args` arguments are per-row
  (leading axis N) and the rest weights (so are its outputs, one or a tuple): with
  unbatched weights the batch axis is folded into the rows (one kernel call over B*N
  rows), else one call per batch element."""
  f = jax.custom_batching.custom_vmap(fn)

  @f.def_vmap
  def rule(axis_size, in_batched, *args):
    rows, weights = args[:n_rows_args], args[n_rows_args:]
    bcast = lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
    rows = [bcast(a, b) for a, b in zip(rows, in_batched[:n_rows_args])]
    if not any(in_batched[n_rows_args:]):
      n = rows[0].shape[1]
      y = f(*[a.reshape((axis_size * n,) + a.shape[2:]) for a in rows], *weights)
      y = jax.tree.map(lambda a: a.reshape((axis_size, n) + a.shape[1:]), y)
      return y, jax.tree.map(lambda _: True, y)
    weights = [bcast(a, b) for a, b in zip(weights, in_batched[n_rows_args:])]
    y = jax.lax.map(lambda a: f(*a), (*rows, *weights))
    return y, jax.tree.map(lambda _: True, y)

  return f


def _expert_call(x_NxD, ids_NxK, gates_NxK, gate_up_Ex2IxD, down_ExDxI):
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype))(
      x_NxD, ids_NxK.astype(jnp.int32), gates_NxK.astype(jnp.float32), gate_up_Ex2IxD,
      down_ExDxI)


_call = rows_vmap(_expert_call, 3)


def expert_ffn(x_NxD, ids_NxK, gates_NxK, w: dict, xla_fn):
  """sum_k gates[n,k] * expert_{ids[n,k]}(x[n]) on CPU: the kernel; elsewhere `xla_fn`.

  `xla_fn(x, ids, gates, w)` is the XLA dispatch: other platforms run it, and the
  backward pass differentiates it.  Weights that are one layer of stacked ones
  (`layer_view.at`) are read there in place (forward only: the engine's scan).
  """
  v = layer_view.common([w["gate_up"], w["down"]])
  if v is not None:
    (gu, dn), i = v
    at = lambda x, ids, g, i, gu, dn: jax.ffi.ffi_call(
        TARGET_AT, jax.ShapeDtypeStruct(x.shape, x.dtype))(
            i.astype(jnp.int32), x, ids.astype(jnp.int32), g.astype(jnp.float32), gu, dn)
    return jax.lax.platform_dependent(
        x_NxD, ids_NxK, gates_NxK, i, gu, dn, cpu=at,
        default=lambda x, ids, g, *_: xla_fn(x, ids, g, {k: _bits_as_bf16(a)
                                                         for k, a in w.items()}))
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
  return tuple(jax.ffi.ffi_call(LINEAR_TARGET, tuple(
      jax.ShapeDtypeStruct((x_NxD.shape[0], w.shape[0]), x_NxD.dtype) for w in ws_OxD))(
          x_NxD, *ws_OxD))


_linears_call = rows_vmap(_linears_ffi, 1)


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
  most = ((LINEAR_MAX_TOKENS_BF16_WIDE if lanes() == 16 else LINEAR_MAX_TOKENS_BF16)
          if dt == jnp.bfloat16 else LINEAR_MAX_TOKENS)
  if (x_NxD.shape[0] <= most and dt in ok and not small_f32
      and all(jnp.dtype(w.dtype) == dt for w in ws_OxD) and available()):
    v = layer_view.common(ws_OxD)
    if v is not None:   # one layer of stacked weights, read in place (forward only)
      stacks, i = v
      at = lambda x, i, *ws: tuple(jax.ffi.ffi_call(LINEAR_AT_TARGET, tuple(
          jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype) for w in ws))(
              i.astype(jnp.int32), x, *ws))
      return jax.lax.platform_dependent(x_NxD, i, *stacks, cpu=at,
                                        default=lambda x, *_: _einsums(x, *ws_OxD))
    return _linears_kernel(x_NxD, ws_OxD)
  return _einsums(x_NxD, *ws_OxD)


def linear(x_NxD, w_OxD):
  """x @ w.T: `linears` with one weight."""
  return linears(x_NxD, (w_OxD,))[0]


def quant_linears(x_NxD, ws_OxD, xla_fn=None):
  """x @ w.T for GGUF-block weights (QuantArrays) on the CPU kernels, or None where they
  do not take them (`cpu_quant.quant_linears`; moejax.model.quant_ops looks it up here)."""
  from moejax.kernels import cpu_quant   # pylint: disable=import-outside-toplevel  # it imports this module
  return cpu_quant.quant_linears(x_NxD, ws_OxD, xla_fn)


def quant_expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_fn=None):
  """The routed experts on GGUF-block weights on the CPU kernels, or None where they do not
  take them (`cpu_quant.quant_expert_ffn`)."""
  from moejax.kernels import cpu_quant   # pylint: disable=import-outside-toplevel
  return cpu_quant.quant_expert_ffn(x_NxD, ids_NxK, gates_NxK, w, xla_fn)
