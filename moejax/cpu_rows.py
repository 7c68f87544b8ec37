"""An RMSNorm and the softmax router rule as one CPU custom call each (``cpu_rows.cc``,
built and registered with the expert kernel by ``cpu_kernel``).

XLA's CPU backend compiles an RMSNorm to 3-4 thunks and softmax + top-k + renormalisation
to about 6, each with a fixed cost of about a microsecond; on a small model that is a
tenth of a decode step (docs/speed.md, "Row-wise kernels"). Both functions here take an
``xla_fn`` with the same meaning: other platforms compile it, and the backward pass
differentiates it (``custom_vjp``), so training is unchanged. Results agree with XLA's to
float rounding (``tests/test_cpu_rows.py``). Under ``vmap`` the batch is folded into the
rows of one call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax import cpu_kernel

_OK = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _norm_call(x_RxD, w_D, *, eps: float):
  return jax.ffi.ffi_call(cpu_kernel.RMS_NORM_TARGET,
                          jax.ShapeDtypeStruct(x_RxD.shape, x_RxD.dtype))(
                              x_RxD, w_D, eps=np.float32(eps))


@functools.lru_cache(maxsize=None)
def _norm_caller(eps: float):
  return cpu_kernel.rows_vmap(functools.partial(_norm_call, eps=eps), 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x_RxD, w_D, eps: float, xla_fn):
  call = _norm_caller(eps)
  return jax.lax.platform_dependent(x_RxD, w_D, cpu=call,
                                    default=lambda x, w: xla_fn(x, w, eps))


def _norm_fwd(x_RxD, w_D, eps, xla_fn):
  return _rms_norm(x_RxD, w_D, eps, xla_fn), (x_RxD, w_D)


def _norm_bwd(eps, xla_fn, res, g_RxD):
  x_RxD, w_D = res
  return jax.vjp(lambda x, w: xla_fn(x, w, eps), x_RxD, w_D)[1](g_RxD)


_rms_norm.defvjp(_norm_fwd, _norm_bwd)


def rms_norm(x, w_D, eps: float, xla_fn):
  """`xla_fn(x, w, eps)` (an RMSNorm over the last axis), as the kernel on CPU when x and
  w share an f32/bf16 dtype; else `xla_fn` itself."""
  dt = jnp.dtype(x.dtype)
  if dt not in _OK or jnp.dtype(w_D.dtype) != dt or w_D.ndim != 1 or not cpu_kernel.available():
    return xla_fn(x, w_D, eps)
  y = _rms_norm(x.reshape(-1, x.shape[-1]), w_D, float(eps), xla_fn)
  return y.reshape(x.shape)


def _route_call(logits_RxE, *, k: int, renorm: bool):
  r, e = logits_RxE.shape
  return jax.ffi.ffi_call(cpu_kernel.ROUTE_SOFTMAX_TARGET, (
      jax.ShapeDtypeStruct((r, k), jnp.int32), jax.ShapeDtypeStruct((r, k), jnp.float32),
      jax.ShapeDtypeStruct((r, e), jnp.float32)))(logits_RxE, renorm=int(renorm))


@functools.lru_cache(maxsize=None)
def _route_caller(k: int, renorm: bool):
  return cpu_kernel.rows_vmap(functools.partial(_route_call, k=k, renorm=renorm), 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _route(logits_RxE, k: int, renorm: bool, xla_fn):
  call = _route_caller(k, renorm)
  return jax.lax.platform_dependent(logits_RxE, cpu=call, default=xla_fn)


def _route_fwd(logits_RxE, k, renorm, xla_fn):
  return _route(logits_RxE, k, renorm, xla_fn), logits_RxE


def _route_bwd(k, renorm, xla_fn, logits_RxE, cts):
  _, g_gates, g_scores = cts
  f = lambda lg: xla_fn(lg)[1:]
  return jax.vjp(f, logits_RxE)[1]((g_gates, g_scores))


_route.defvjp(_route_fwd, _route_bwd)


def route_softmax(logits_NxE, k: int, renorm: bool, xla_fn):
  """(ids [...,K] int32, gates [...,K], scores [...,E]) of f32 logits [..., E]: the
  softmax rule `xla_fn(logits)`, as the kernel on CPU (ties to the lower expert index, like
  top_k)."""
  if jnp.dtype(logits_NxE.dtype) != jnp.float32 or not cpu_kernel.available():
    return xla_fn(logits_NxE)
  lead, e = logits_NxE.shape[:-1], logits_NxE.shape[-1]
  ids, gates, scores = _route(logits_NxE.reshape(-1, e), int(k), bool(renorm), xla_fn)
  return ids.reshape(*lead, -1), gates.reshape(*lead, -1), scores.reshape(*lead, e)
