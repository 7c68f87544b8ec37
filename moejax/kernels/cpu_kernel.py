"""The CPU kernels' one library (``cpu_*.cc``, built by ``cpu_build``) on XLA's CPU backend:
its FFI targets, loaded and registered once, the one switch ``available()``, and the
decode helper threads.  The wrappers that call the targets live beside their C++:
``cpu_matmul`` (expert FFN, linears), ``cpu_rows``, ``cpu_attention``, ``cpu_host``,
``cpu_quant``.  The library is compiled with the system C++ compiler on first use into a
cache keyed by the sources, flags, compiler and instruction set (``cpu_build``).

``available()`` is the one switch every caller asks. ``MOEJAX_CPU_KERNEL``: unset or
``1`` (any value but the ones below): the kernels on JAX's CPU backend, built on first
use; ``0``, ``off``, ``false`` or ``no``: never built nor used. On any other default
backend (a GPU host) they are never built nor loaded and XLA's ops run everywhere.
Without a compiler, or when the build fails, one line on stderr says so (once per
process) and XLA's ops run.

The decode helper threads spin between calls only inside ``decoding()`` (the decode
loops of the Sampler, the OffloadEngine and the benchmarks enter it); elsewhere they
sleep right after each job.  ``rows_vmap`` is the wrappers' shared vmap rule.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

import jax
import jax.numpy as jnp

from moejax.kernels import cpu_build

TARGET = "moejax_expert_ffn"
LINEAR_TARGET = "moejax_linear"
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


def experts_at(target_at: str, x, ids, gates, stacks, i, xla_fn):
  """An expert kernel's `_at` form (cpu_layer.h) on layer i of stacked gate_up and down
  (`stacks`, `i`: `layer_view.common`'s), read where they lie on the CPU; elsewhere
  `xla_fn(x, ids, gates)`.  Forward only (the engine's scan over layers)."""
  gu, dn = stacks
  call = lambda x, ids, g, i, gu, dn: jax.ffi.ffi_call(
      target_at, jax.ShapeDtypeStruct(x.shape, x.dtype))(
          i.astype(jnp.int32), x, ids.astype(jnp.int32), g.astype(jnp.float32), gu, dn)
  return jax.lax.platform_dependent(x, ids, gates, i, gu, dn, cpu=call,
                                    default=lambda x, ids, g, *_: xla_fn(x, ids, g))
