"""Tokens through their K experts read in place from the offload engine's host store, as one
CPU custom call (``cpu_host.cc``, built and registered with the other kernels by
``cpu_kernel``): the engine's HOST misses on the CPU backend (``offload.sources``).

The store holds bf16 experts as their uint16 bits (``placement.program_store``); the
kernel reads them, or f32/bf16 ones, in place, where the XLA path first copies each
selected expert out of the store (a dynamic slice of 9.4 MB per Qwen3-30B-A3B expert)
and then runs the routed-expert kernel on the copies. Experts whose gate is 0 are not
read. Other platforms, and a build without the kernels, keep the XLA path (the caller's
``xla_fn``). Forward only: the engine does not differentiate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import cpu_kernel
from moejax.kernels import layer_view

_ACT = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_WEIGHTS = _ACT + (jnp.dtype(jnp.uint16),)


def supports(x, w: dict) -> bool:
  """Plain SwiGLU experts ({"gate_up" [E, 2I, D], "down" [E, D, I]}, f32, bf16 or bf16
  bits) and f32/bf16 tokens x [D] or [B, D]: the kernel can compute them (when
  `cpu_kernel.available()`)."""
  if set(w) != {"gate_up", "down"} or jnp.dtype(x.dtype) not in _ACT or x.ndim not in (1, 2):
    return False
  gu, dn = w["gate_up"], w["down"]
  return (jnp.dtype(gu.dtype) in _WEIGHTS and gu.dtype == dn.dtype and gu.ndim == 3
          and dn.ndim == 3 and gu.shape[2] == x.shape[-1] == dn.shape[1]
          and gu.shape[1] == 2 * dn.shape[2] and gu.shape[0] == dn.shape[0])


def _call(x, ids, gates, gate_up, down):
  return jax.ffi.ffi_call(cpu_kernel.HOST_EXPERTS_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(
      x, ids.astype(jnp.int32), gates.astype(jnp.float32), gate_up, down)


def host_experts(x, ids, gates, w: dict, xla_fn):
  """sum_j gates[.., j] * expert_{ids[.., j]}(x) of one token x [D] (ids, gates [K]) or of
  B tokens x [B, D] (ids, gates [B, K]) in one call, experts read in place from `w`: the
  kernel on the CPU, elsewhere `xla_fn(x [B, D], ids [B, K], gates [B, K], w)`
  (`apply_experts`' signature). Call it only when `supports(x, w)` and
  `cpu_kernel.available()`.  A store that is one layer of a stacked one
  (`layer_view.at`) is read there in place."""
  def xla(x, i, g, w):
    rows = lambda a: a.reshape((-1,) + a.shape[-1:])
    return xla_fn(rows(x), rows(i), rows(g), w).reshape(x.shape).astype(x.dtype)
  v = layer_view.common([w["gate_up"], w["down"]])
  if v is not None:
    return cpu_kernel.experts_at(cpu_kernel.HOST_EXPERTS_AT_TARGET, x, ids, gates, *v,
                                 lambda x, ids, g: xla(x, ids, g, w))
  return jax.lax.platform_dependent(
      x, ids, gates, w["gate_up"], w["down"], cpu=_call,
      default=lambda x, i, g, gu, dn: xla(x, i, g, {"gate_up": gu, "down": dn}))
