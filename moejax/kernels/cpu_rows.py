"""An RMSNorm, the softmax router rule, a top-k, a weighted bincount, the bf16 embedding
lookup and a KV cache's in-place row write as one CPU custom call each (``cpu_rows.cc``,
built and registered with the expert kernel by ``cpu_kernel``).

XLA's CPU backend compiles an RMSNorm to 3-4 thunks and softmax + top-k + renormalisation
to about 6, each with a fixed cost of about a microsecond; on a small model that is a
tenth of a decode step (docs/lab/notes/cpu_speed.md, "Row-wise kernels"); XLA splits the bf16
lookup over its thread pool. Each function here has an XLA form with the same meaning (an
``xla_fn`` argument, or ``jax.lax.top_k`` and a one-hot sum): other platforms compile it,
and the backward pass differentiates it (``custom_vjp``), so training is unchanged.
Results agree with XLA's to float rounding (``tests/test_cpu_rows.py``). Under ``vmap``
the batch is folded into the rows of one call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel

_OK = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_or_xla(call, xla_fn, *args):
  """`call(*args)` (a kernel) on CPU, `xla_fn(*args)` elsewhere; gradients are
  `xla_fn`'s (integer outputs get none)."""
  return jax.lax.platform_dependent(*args, cpu=call, default=xla_fn)


def _kernel_fwd(call, xla_fn, *args):
  return _kernel_or_xla(call, xla_fn, *args), args


def _kernel_bwd(call, xla_fn, args, cts):
  del call
  return jax.vjp(xla_fn, *args)[1](cts)


_kernel_or_xla.defvjp(_kernel_fwd, _kernel_bwd)


def _norm_call(x_RxD, w_D, *, eps: float):
  return jax.ffi.ffi_call(cpu_kernel.RMS_NORM_TARGET,
                          jax.ShapeDtypeStruct(x_RxD.shape, x_RxD.dtype))(
                              x_RxD, w_D, eps=np.float32(eps))


@functools.lru_cache(maxsize=None)
def _norm_caller(eps: float):
  return cpu_kernel.rows_vmap(functools.partial(_norm_call, eps=eps), 1)


def rms_norm(x, w_D, eps: float, xla_fn):
  """`xla_fn(x, w, eps)` (an RMSNorm over the last axis), as the kernel on CPU when x and
  w share an f32/bf16 dtype; else `xla_fn` itself."""
  dt = jnp.dtype(x.dtype)
  if dt not in _OK or jnp.dtype(w_D.dtype) != dt or w_D.ndim != 1 or not cpu_kernel.available():
    return xla_fn(x, w_D, eps)
  y = _kernel_or_xla(_norm_caller(float(eps)), functools.partial(xla_fn, eps=eps),
                     x.reshape(-1, x.shape[-1]), w_D)
  return y.reshape(x.shape)


def _route_call(logits_RxE, *, k: int, renorm: bool):
  r, e = logits_RxE.shape
  return jax.ffi.ffi_call(cpu_kernel.ROUTE_SOFTMAX_TARGET, (
      jax.ShapeDtypeStruct((r, k), jnp.int32), jax.ShapeDtypeStruct((r, k), jnp.float32),
      jax.ShapeDtypeStruct((r, e), jnp.float32)))(logits_RxE, renorm=int(renorm))


@functools.lru_cache(maxsize=None)
def _route_caller(k: int, renorm: bool):
  return cpu_kernel.rows_vmap(functools.partial(_route_call, k=k, renorm=renorm), 1)


def route_softmax(logits_NxE, k: int, renorm: bool, xla_fn):
  """(ids [...,K] int32, gates [...,K], scores [...,E]) of f32 logits [..., E]: the
  softmax rule `xla_fn(logits)`, as the kernel on CPU (ties to the lower expert index, like
  top_k)."""
  if jnp.dtype(logits_NxE.dtype) != jnp.float32 or not cpu_kernel.available():
    return xla_fn(logits_NxE)
  lead, e = logits_NxE.shape[:-1], logits_NxE.shape[-1]
  ids, gates, scores = _kernel_or_xla(_route_caller(int(k), bool(renorm)), xla_fn,
                                      logits_NxE.reshape(-1, e))
  return ids.reshape(*lead, -1), gates.reshape(*lead, -1), scores.reshape(*lead, e)


def _top_k_call(x_RxE, *, k: int):
  r = x_RxE.shape[0]
  return jax.ffi.ffi_call(cpu_kernel.TOP_K_TARGET, (
      jax.ShapeDtypeStruct((r, k), jnp.float32), jax.ShapeDtypeStruct((r, k), jnp.int32)))(x_RxE)


@functools.lru_cache(maxsize=None)
def _top_k_caller(k: int):
  return (cpu_kernel.rows_vmap(functools.partial(_top_k_call, k=k), 1),
          lambda x: tuple(jax.lax.top_k(x, k)))


def top_k(x, k: int):
  """`jax.lax.top_k(x, k)` of f32 x [..., E] (values descending, ties to the lower index),
  as the kernel on CPU: XLA CPU's TopK was 18% of a simulator sweep (docs/simulator.md).
  For inputs without NaN (scores, or -inf for what is left out)."""
  lead, e = x.shape[:-1], x.shape[-1]
  if jnp.dtype(x.dtype) != jnp.float32 or not 1 <= k <= e or not cpu_kernel.available():
    return jax.lax.top_k(x, k)        # (a bad k: its own error message)
  vals, ids = _kernel_or_xla(*_top_k_caller(int(k)), x.reshape(-1, e))
  return vals.reshape(*lead, k), ids.reshape(*lead, k)


def _bin_sum_call(ids_RxK, w_RxK, *, bins: int):
  return jax.ffi.ffi_call(cpu_kernel.BIN_SUM_TARGET,
                          jax.ShapeDtypeStruct((ids_RxK.shape[0], bins), jnp.float32))(
                              ids_RxK, w_RxK)


def _bin_sum_xla(ids, w, bins: int):
  return jnp.sum(jnp.where(ids[..., :, None] == jnp.arange(bins), w[..., :, None], 0.0),
                 axis=-2)


@functools.lru_cache(maxsize=None)
def _bin_sum_caller(bins: int):
  return (cpu_kernel.rows_vmap(functools.partial(_bin_sum_call, bins=bins), 2),
          functools.partial(_bin_sum_xla, bins=bins))


def bin_sum(ids, w, bins: int):
  """out[..., e] = the sum of w[..., k] over the k with ids[..., k] == e (ids outside [0,
  bins) add nothing), added in k order: a weighted bincount of int ids [..., K] and f32 w
  [..., K] into `bins`, as the kernel on CPU (XLA CPU builds the [K, bins] one-hot and
  reduces it, docs/simulator.md)."""
  ids, w = ids.astype(jnp.int32), jnp.asarray(w, jnp.float32)
  if not cpu_kernel.available():
    return _bin_sum_xla(ids, w, bins)
  lead, k = ids.shape[:-1], ids.shape[-1]
  out = _kernel_or_xla(*_bin_sum_caller(int(bins)), ids.reshape(-1, k), w.reshape(-1, k))
  return out.reshape(*lead, bins)


def _take_call(ids_N, table_VxD):
  return jax.ffi.ffi_call(cpu_kernel.TAKE_ROWS_TARGET,
                          jax.ShapeDtypeStruct(ids_N.shape + table_VxD.shape[1:],
                                               table_VxD.dtype))(ids_N, table_VxD)


_take_caller = cpu_kernel.rows_vmap(_take_call, 1)


def take_rows(table_VxD, ids, cpu_xla_fn):
  """`jnp.take(table, ids, axis=0)` of a bf16 table: the kernel on CPU (XLA splits its
  fused lookup over the thread pool at every step, docs/lab/notes/cpu_speed.md), else
  `cpu_xla_fn(table, ids)` whenever the kernels are not used (`cpu_kernel.available()`:
  switched off, no compiler, or a default backend other than the CPU, whatever compilers
  it has); jnp.take for gradients."""
  if jnp.dtype(table_VxD.dtype) != jnp.bfloat16 or not cpu_kernel.available():
    return cpu_xla_fn(table_VxD, ids)
  xla_fn = lambda i, t: jnp.take(t, i, axis=0)
  rows = _kernel_or_xla(_take_caller, xla_fn, ids.reshape(-1).astype(jnp.int32), table_VxD)
  return rows.reshape(ids.shape + table_VxD.shape[1:])


def copy_rows(dst, dst_start, src, src_start, xla_fn):
  """dst with src's block at src_start written at dst_start (a block: one index of each
  indexed dim, all of the rest, the same in both; e.g. a stored expert [L, E, ...] at
  (l, e) into slot buffers [L, P, ...] at (l, slot)), in place in dst's buffer: one copy
  from src's buffer on the CPU (XLA slices the block out into a buffer of its own and the
  update copies it again: 3.9 ms a token of wide_bf16 under fetch_all at 25%), else
  `xla_fn(dst, src)`.  The dtypes may differ if their widths do not (bf16 and its bits);
  decode only (no gradient)."""
  kd, ks = len(dst_start), len(src_start)
  if (not cpu_kernel.available() or not 1 <= kd <= dst.ndim or not 1 <= ks <= src.ndim
      or dst.shape[kd:] != src.shape[ks:] or dst.dtype.itemsize != src.dtype.itemsize):
    return xla_fn(dst, src)
  wrap = lambda i, n: jnp.where(jnp.asarray(i, jnp.int32) < 0, i + n, i).astype(jnp.int32)
  at_d = jnp.stack([wrap(i, n) for i, n in zip(dst_start, dst.shape)])
  at_s = jnp.stack([wrap(i, n) for i, n in zip(src_start, src.shape)])
  return jax.lax.platform_dependent(dst, src, at_d, at_s, cpu=_copy_call,
                                    default=lambda d, s, *_: xla_fn(d, s))


def _copy_call(dst, src, at_d, at_s):
  return jax.ffi.ffi_call(cpu_kernel.COPY_ROWS_TARGET, jax.ShapeDtypeStruct(dst.shape, dst.dtype),
                          input_output_aliases={0: 0}, vmap_method="sequential")(
                              dst, src, at_d, at_s)


def will_need(src, at_JxK, n):
  """n (an int32 scalar), on the CPU after asking the OS to read src's blocks at
  at_JxK[:n] (blocks as `copy_rows`'s: one index of each of the first K dims, all of the
  rest) into the page cache at once (madvise MADV_WILLNEED); a hint, so elsewhere n as it
  is.  A loop bounded by the result copies after it: the blocks of a memory-mapped store
  are then read together, where each copy's page faults read one after another."""
  n = jnp.asarray(n, jnp.int32)
  if not cpu_kernel.available() or at_JxK.ndim != 2 or not 1 <= at_JxK.shape[1] <= src.ndim:
    return n
  return jax.lax.platform_dependent(src, at_JxK.astype(jnp.int32), n, cpu=_will_need_call,
                                    default=lambda s, a, m: m)


def _will_need_call(src, at_JxK, n):
  return jax.ffi.ffi_call(cpu_kernel.WILL_NEED_TARGET, jax.ShapeDtypeStruct((), jnp.int32),
                          vmap_method="sequential")(src, at_JxK, n)


def _write_call(x, rows, start):
  return jax.ffi.ffi_call(cpu_kernel.WRITE_ROWS_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0}, vmap_method="sequential")(x, rows, start)


def write_rows(x, rows, start, xla_fn):
  """`lax.dynamic_update_slice(x, rows, (*start, 0, ...))` for rows whose dims after the
  len(start) indexed ones are x's (a KV cache [B, S, ...] at (b, s), a stack of them at
  (l, b, s)), in place in x's buffer: the kernel on CPU, else `xla_fn(x, rows)`.  For 16-bit
  float arrays, which XLA's CPU backend updated with a pass over the whole array
  (docs/lab/notes/cpu_speed.md); decode only (no gradient)."""
  k = len(start)
  if (not cpu_kernel.available() or not 1 <= k <= x.ndim or x.ndim != rows.ndim
      or rows.shape[k:] != x.shape[k:] or rows.dtype != x.dtype):
    return xla_fn(x, rows)
  wrap = lambda i, n: jnp.where(jnp.asarray(i, jnp.int32) < 0, i + n, i).astype(jnp.int32)
  at = jnp.stack([wrap(i, n) for i, n in zip(start, x.shape)])   # as lax wraps them
  return jax.lax.platform_dependent(x, rows, at, cpu=_write_call,
                                    default=lambda c, r, _: xla_fn(c, r))
