"""The sum of one array over the devices of a single-process CPU mesh as one CPU custom
call per device (``cpu_collective.cc``, built and registered with the other kernels by
``cpu_kernel``): expert parallelism's psum where the devices are host devices.

XLA's in-process all-reduce parks and wakes a thread per device: 17-30 us a call
between two host devices of a 2-core machine, which made the psum of each MoE layer
the whole cost of running the demo model over two devices. The kernel's devices meet
at a barrier in shared memory instead and add the partials in device order, so every
device gets the same bits (docs/expert_parallel.md). Where the mesh spans processes or
non-CPU devices, or the kernels are off, ``usable`` says no and the caller keeps
``jax.lax.psum``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel

_CLIQUES = itertools.count(1)
_OK = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def usable(devices) -> bool:
  """Whether the kernel can sum over `devices`: more than one, all CPU devices of this
  process, and the kernels available."""
  devices = list(devices)
  return (len(devices) > 1 and all(d.platform == "cpu" for d in devices)
          and all(d.process_index == jax.process_index() for d in devices)
          and cpu_kernel.available())


def new_clique() -> int:
  """A fresh meeting point (one per mesh user: calls of one clique pair up in order)."""
  return next(_CLIQUES)


def all_reduce(x, axis_name: str, devices: int, clique: int):
  """Inside a shard_map over `axis_name` (`devices` CPU devices of this process): the sum
  of x over the axis, every device's copy bit-identical. f32 and bf16 (added in f32);
  other dtypes go through `jax.lax.psum`."""
  if jnp.dtype(x.dtype) not in _OK:
    return jax.lax.psum(x, axis_name)
  index = jax.lax.axis_index(axis_name).astype(jnp.int32)
  return jax.ffi.ffi_call(cpu_kernel.ALL_REDUCE_TARGET,
                          jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=False)(
                              x, index, clique=np.int64(clique), devices=np.int64(devices))
