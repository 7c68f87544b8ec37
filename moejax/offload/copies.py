"""Owned copies of experts: host stacks and device arrays that never alias the store.

On the CPU backend `jax.device_put` of a numpy array (or a memmap) may wrap the
host buffer instead of copying it, so slot buffers and transfer results must be
owned copies; `owned_device_put` detects aliasing and copies.  Experts of one
layer are stacked into one array per weight so an insert takes one argument per
weight (`stacked_device_put`, `host_stack`).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


def _host_pointer(x) -> int | None:
  if isinstance(x, np.ndarray):
    return x.__array_interface__["data"][0]
  if isinstance(x, jax.Array):
    try:
      return x.unsafe_buffer_pointer()
    except Exception:  # pylint: disable=broad-except  (sharded / deleted arrays)
      return None
  return None


def shares_buffer(out: jax.Array, src) -> bool:
  """True when device array `out` aliases the memory of `src` (numpy or jax)."""
  p = _host_pointer(src)
  if p is None or getattr(src, "size", 1) == 0:
    return False
  try:
    return out.unsafe_buffer_pointer() == p
  except Exception:  # pylint: disable=broad-except
    return False


def owned_device_put(x, sharding: jax.sharding.Sharding) -> jax.Array:
  """`jax.device_put(x, sharding)` whose result never aliases x's buffer.

  On an accelerator the put is the host->device copy itself.  On the CPU
  backend jax may wrap the numpy buffer (even a read-only memmap) or return
  the source array; then a private host copy is put instead, which only the
  returned array references (cheaper than an XLA copy, which would also
  compile once per shape).
  """
  out = jax.device_put(x, sharding)
  if shares_buffer(out, x):
    out = jax.device_put(np.array(x, copy=True), sharding)
  return out


@functools.lru_cache(maxsize=None)
def _to_device(sharding: jax.sharding.Sharding, rows: int):
  """Host stack [n, ...] -> device arrays [rows, ...] (zero rows appended on the device)."""
  def pad(tree):
    return {k: jnp.concatenate([v, jnp.zeros((rows - v.shape[0],) + v.shape[1:], v.dtype)])
            if v.shape[0] < rows else v for k, v in tree.items()}
  return jax.jit(pad, out_shardings=sharding)


def _aligned_zeros(shape, dtype, align: int = 64) -> np.ndarray:
  """np.zeros in a buffer aligned to `align` bytes: XLA CPU takes such a buffer as a
  jit argument without copying it (a 16-byte aligned one is copied first)."""
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = np.zeros(nbytes + align, np.uint8)
  off = -raw.ctypes.data % align
  return raw[off:off + nbytes].view(dtype).reshape(shape)


def host_stack(srcs: list[dict], pad_to: int = 0) -> dict[str, np.ndarray]:
  """Experts {name: host array} stacked into private, 64-byte aligned host arrays
  [max(n, pad_to), ...] (zero rows past n)."""
  n = max(len(srcs), pad_to)
  out = {}
  for k, v in srcs[0].items():
    v = np.asarray(v)
    out[k] = _aligned_zeros((n,) + v.shape, v.dtype)
    for j, src in enumerate(srcs):
      out[k][j] = src[k]
  return out


def stacked_device_put(srcs: list[dict], sharding: jax.sharding.Sharding,
                       pad_to: int = 0) -> dict[str, jax.Array]:
  """Experts {name: array} stacked into owned device arrays [max(len(srcs), pad_to), ...].

  Numpy (or memmap) sources are stacked into a private host array first, which
  the device copy may alias but never the store's buffers; only the n real rows
  cross, the zero rows past them are written on the device.  Into device memory
  the copy is a jitted call (cheaper per call than `jax.device_put` of the same
  arrays); it compiles once per (n, rows) -- `OffloadEngine.warmup` compiles
  them all.  jax sources (a pinned_host store) are put, then stacked on the device.
  """
  n = max(len(srcs), pad_to)
  if all(isinstance(v, np.ndarray) for src in srcs for v in src.values()):
    host = {k: np.stack([src[k] for src in srcs]) for k in srcs[0]}
    if sharding.memory_kind in (None, next(iter(sharding.device_set)).default_memory().kind):
      return _to_device(sharding, n)(host)
    return jax.device_put({k: np.concatenate([v, np.zeros((n - len(srcs),) + v.shape[1:],
                                                          v.dtype)]) for k, v in host.items()},
                          sharding)
  dev = jax.device_put(srcs, sharding)
  return {k: jnp.concatenate([jnp.stack([d[k] for d in dev]),
                              jnp.zeros((n - len(dev),) + dev[0][k].shape, dev[0][k].dtype)])
          .astype(dev[0][k].dtype) for k in dev[0]}


def sleep_until(deadline: float, spin_s: float = 2e-4):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop
  (time.sleep(0): the GIL is released every turn), since a plain sleep on a
  loaded machine overshoots by milliseconds."""
  while (left := deadline - time.perf_counter()) > 0:
    time.sleep(left - spin_s if left > 2 * spin_s else 0)
