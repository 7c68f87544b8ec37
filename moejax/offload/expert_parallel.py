"""Expert parallelism: each MoE layer's expert slots spread over the devices of a mesh.

A `Plan` puts a Mesh with one axis, "expert", over N devices with S_d slots per MoE
layer each (the budget is per device).  The layer's `ResidentState` metadata is global
and replicated, so the union is ONE cache of N * S_d slots (at most E) and `decide`,
insert, eviction and admission are the single-device functions over it.  Global slot s
lives on device s mod N at local row s // N (interleaved: the experts a layer takes in
one after another spread over the devices).  Any device may hold any expert, so the
host store is replicated per device.  Slot buffers [N * (S_d + 1), ...] are sharded on
"expert" (each device: its slots and a scratch row); copies and routed experts run in
`jax.shard_map`, each device on its own slots, and a `psum` adds the partial outputs
(batch 1); everything else is replicated.  Why, and what it measured:
docs/expert_parallel.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "expert"


class ExpertParallelError(ValueError):
  """An expert-parallel setting that cannot work; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """N devices on the "expert" axis, S_d slots per MoE layer on each (hashable: part of
  the decode program's static context)."""
  mesh: Mesh
  slots: int             # S_d: slots per device and MoE layer

  @property
  def devices(self) -> int:
    return self.mesh.shape[AXIS]

  @property
  def rows(self) -> int:
    """Buffer rows per device: its slots and a scratch row."""
    return self.slots + 1

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def by_rows(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(AXIS))


def provide_cpu_devices(n: int):
  """Asks for n CPU devices when JAX's backends start (a CPU-only machine has one); call
  before the first JAX computation.  Harmless where the default backend is an accelerator."""
  if n > 1:
    jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))


def make_plan(n: int, slots_per_device: int, devices=None) -> Plan:
  """A Plan over the first n of `devices` (default: jax.devices(), every process's)."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < n:
    raise ExpertParallelError(
        f"--expert_devices={n}: only {len(devices)} {devices[0].platform} device(s) are "
        f"available (on a CPU-only machine launch.generate provides them itself; in your "
        f"own program call moejax.offload.expert_parallel.provide_cpu_devices({n}) or set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts)")
  return Plan(Mesh(np.asarray(devices[:n]), (AXIS,)), int(slots_per_device))


def _global(x, sharding: NamedSharding):
  """A host or single-device value as a global array with `sharding` (every process
  passes the same value; works where some devices belong to other processes)."""
  host = np.asarray(jax.device_get(x))
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(plan: Plan, tree):
  """Every leaf of `tree` replicated on the plan's devices, in the leaf's memory kind (a
  host store in pinned_host memory stays there, one copy per device)."""
  def one(a):
    kind = getattr(getattr(a, "sharding", None), "memory_kind", None)
    if kind in (None, "device"):
      return _global(a, plan.replicated)
    return _global(a, NamedSharding(plan.mesh, P(), memory_kind=kind))
  return jax.tree_util.tree_map(one, tree)


def shard_state(plan: Plan, state):
  """A single-device ResidentState (slots 0..P-1 in rows 0..P-1, P <= N * S_d) -> the
  same cache laid out for the plan: device d's rows are slots d, d + N, d + 2N, ... and a
  scratch row; the metadata replicated."""
  n = plan.devices
  num_p = state.slot_expert.shape[0]     # <= n * s (`resident.make_budget`)
  bufs = {}
  for name, buf in state.buffers.items():
    host = np.asarray(jax.device_get(buf))
    rows = np.zeros((n * plan.rows,) + host.shape[1:], host.dtype)
    for d in range(n):
      mine = host[d:num_p:n]
      rows[d * plan.rows:d * plan.rows + len(mine)] = mine
    bufs[name] = _global(rows, plan.by_rows)
  meta = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
          if f.name != "buffers"}
  return dataclasses.replace(state, buffers=bufs, **replicate(plan, meta))


def device_rows(plan: Plan, slots_J):
  """Inside the shard_map: this device's local row of each global slot (-1: none here)."""
  d = jax.lax.axis_index(AXIS)
  mine = (slots_J >= 0) & (slots_J % plan.devices == d)
  return jnp.where(mine, slots_J // plan.devices, -1).astype(jnp.int32)


def copy_rows(plan: Plan, copy_fn, buffers: dict, store: dict, ids_J, slots_J, **kw) -> dict:
  """`copy_fn(buffers, store, ids_J, local_slots_J, **kw)` (sources.copy_rows) on every
  device, each copying the rows of the slots it owns from its replica of the store."""
  def local(bufs, st, ids, slots):
    return copy_fn(bufs, st, ids, device_rows(plan, slots), **kw)
  return jax.shard_map(local, mesh=plan.mesh, in_specs=(P(AXIS), P(), P(), P()),
                       out_specs=P(AXIS), check_vma=False)(buffers, store, ids_J, slots_J)


def routed_experts(plan: Plan, experts_fn, x_TxD, rows_TxK, weights_TxK, buffers: dict,
                   local=None):
  """sum_k weights[t, k] * the expert in global row rows[t, k] (x: T tokens), over the
  devices: each computes the rows it holds (others' weights masked to 0) with
  `experts_fn(x, local rows, gates, local buffers)`; a psum adds the parts.  buffers:
  the slot buffers (sharded), or with `local` a replicated store that local(store) turns
  into this device's rows (the prompt: expert e is global row e)."""
  def fn(x, rows, w, bufs):
    mine = device_rows(plan, rows)
    bufs = bufs if local is None else local(bufs)
    y = experts_fn(x, jnp.maximum(mine, 0), jnp.where(mine >= 0, w, 0.0), bufs)
    return jax.lax.psum(y, AXIS)
  bufs_spec = P() if local is not None else P(AXIS)    # a replicated store, or the slots
  return jax.shard_map(fn, mesh=plan.mesh, in_specs=(P(), P(), P(), bufs_spec),
                       out_specs=P(), check_vma=False)(x_TxD, rows_TxK, weights_TxK, buffers)
