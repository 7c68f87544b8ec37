"""Decode-time attention over the static KV cache as a CPU kernel (``cpu_attention.cc``,
built and registered with the expert kernel by ``cpu_kernel``).

``layers.cached_attention`` uses it for a few query positions over a cache on the CPU
platform (``jax.lax.platform_dependent``: elsewhere XLA's `gqa_attention`).  It reads
the cache in place and visits only the positions a query can see; XLA's path copies the
key cache into the score dot's layout at every step and softmaxes over every position
(docs/lab/notes/cpu_speed.md).  Results agree with `gqa_attention` to float rounding
(`tests/test_cpu_attention.py`); the decode path is never differentiated (training runs
without a cache), so there is no gradient rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel
from moejax.kernels import layer_view

MAX_QUERIES = 16     # query positions per call (decode); more: XLA's attention


def supports(q_BxTxHxK, k_cache, v_cache) -> bool:
  ok = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
  return (q_BxTxHxK.shape[1] <= MAX_QUERIES and jnp.dtype(q_BxTxHxK.dtype) in ok
          and jnp.dtype(k_cache.dtype) in ok and k_cache.dtype == v_cache.dtype
          and cpu_kernel.available())


def _call(q, k, v, q_pos, sinks, *, scale: float, window: int, has_sinks: int):
  # leading dims are the kernel's batch (a vmap adds one in front: broadcast_all)
  out = jax.ffi.ffi_call(
      cpu_kernel.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
      vmap_method="broadcast_all")(
          q, k, v, q_pos.astype(jnp.int32), sinks.astype(jnp.float32),
          scale=np.float32(scale), window=int(window), has_sinks=int(has_sinks))
  return out.reshape(q.shape[:-2] + (-1,))


def decode_attention(q_BxTxHxK, k_BxSxGxK, v_BxSxGxV, q_pos_BxT, scale: float,
                     window: int | None, sinks_H, xla_fn):
  """Causal attention of the queries over the whole cache (positions 0..S-1, a key
  visible when its position <= the query's, and > query - window with a window);
  [B, T, H*V].  `xla_fn()` is XLA's path, compiled on other platforms.  A cache that is
  one layer of a stacked one (`layer_view.at`) is read there in place."""
  h = q_BxTxHxK.shape[2]
  sinks = jnp.zeros((h,), jnp.float32) if sinks_H is None else sinks_H
  v = layer_view.common([k_BxSxGxK, v_BxSxGxV])
  if v is not None:   # one layer of a stacked cache, read in place (no vmap: the engine)
    (ks, vs), i = v
    at = lambda q, i, k, v, p, s: jax.ffi.ffi_call(
        cpu_kernel.ATTENTION_AT_TARGET, jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:],
                                                             q.dtype))(
            i.astype(jnp.int32), q, k, v, p.astype(jnp.int32), s.astype(jnp.float32),
            scale=np.float32(scale), window=int(window or 0),
            has_sinks=int(sinks_H is not None)).reshape(q.shape[:-2] + (-1,))
    return jax.lax.platform_dependent(q_BxTxHxK, i, ks, vs, q_pos_BxT, sinks, cpu=at,
                                      default=lambda *a: xla_fn())
  kernel = lambda q, k, v, p, s: _call(q, k, v, p, s, scale=scale, window=window or 0,
                                       has_sinks=int(sinks_H is not None))
  return jax.lax.platform_dependent(q_BxTxHxK, k_BxSxGxK, v_BxSxGxV, q_pos_BxT, sinks,
                                    cpu=kernel, default=lambda *a: xla_fn())
