"""Expert sources of a MoE layer: where `decode.moe_layer` reads its experts from.

  table   every expert on the device, read by id (the emulator); with low-precision
          copies the table holds 2E experts, the dequantised copy of e at E + e;
  slots   the layer's slot buffers, filled by in-program copies from the host store
          (`copy_rows`): full-precision rows as they are, low-precision ones
          (`io.quant`) dequantised on the way into the slot; HOST experts computed from
          the store where it lives (the engine).
The program reads the host store as `io.placement.program_store` lays it out and places it
(per MoE layer one stacked `[E, ...]` array per tensor kind, so a fetch is one dynamic
slice).  With a host staging tier (`io.staging`, --host_cache_gb) a layer's store is a
`staging.Staged`: each copied row comes from a host callback (the staged row, or the
mapped file's).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.cache import policy as policy_lib
from moejax.cache import resident as resident_lib
from moejax.cache.policy import HOST
from moejax.io import quant
from moejax.io import staging
from moejax.kernels import cpu_host, cpu_kernel, cpu_matmul, layer_view
from moejax.model import experts as experts_lib
from moejax.model import families
from moejax.model import quant_ops
from moejax.offload import expert_parallel


def to_device(x, pinned):
  """A slice of a host-memory store moved to device memory (pinned: True, the single
  device's; "local", inside a shard_map: each device's own)."""
  if pinned == "local":
    return jax.device_put(x, jax.memory.Space.Device)
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind="device")) if pinned else x


def _row(src, i, dtype, pinned):
  """src[i:i+1] on the device, as `dtype`.  The program store holds 16-bit floats as their
  uint16 bits (`placement.program_store`): XLA CPU slices a bf16 array by converting all
  of it to f32 first, and hoists that convert of the whole store out of the copy loop."""
  return as_dtype(to_device(layer_view.rows(src, i, 1), pinned), dtype)


def as_dtype(rows, dtype):
  """Store rows as `dtype` (16-bit floats stored as their uint16 bits: a bitcast)."""
  if rows.dtype != dtype and rows.dtype.itemsize == jnp.dtype(dtype).itemsize:
    return jax.lax.bitcast_convert_type(rows, dtype)
  return rows.astype(dtype)


def _low_row(src, name, i, dtype, pinned, bits: int):
  """The dequantised row i of a low-precision program store (`io.quant` layout)."""
  q, s = (to_device(layer_view.rows(src[f"{name}.{x}"], i, 1), pinned) for x in "qs")
  return quant.dequantize(q, s, bits, dtype)


def copy_rows(buffers: dict, store: dict, ids_J, slots_J, pinned,
              low_bits: int | None = None, mapped: bool = False) -> dict:
  """Copies store[k][ids_J[j]] into buffers[k][slots_J[j]] for every j with a slot, in
  order (a later copy into the same slot wins), inside the program; a skipped entry
  copies nothing.  A pinned_host store's slices are moved to device memory.  low_bits:
  `store` is a low-precision store (`io.quant`), each row dequantised into the slot.
  mapped: a memory-mapped store (the disk tier): the blocks to copy are asked for at once
  first (`layer_view.will_need`), not read fault by fault.

  One `fori_loop` over the copies: a while loop updates the slot buffers in place.  A
  conditional does not: with the buffers as its operand XLA copies every slot buffer
  into and out of it, whichever branch runs (a `lax.switch` on the number of copies, and
  a `lax.cond` on there being any, both measured: 16 buffer copies a token on a 4-layer
  model; docs/engine.md).  On a GPU the loop costs one device->host sync of its bound."""
  j_max = ids_J.shape[0]
  if j_max == 0:
    return buffers
  valid = slots_J >= 0
  at = jnp.where(valid, policy_lib.prefix_count(valid) - 1, j_max)
  to_JxJ = at[None, :] == jnp.arange(j_max)[:, None]     # [to, from]: compaction, no scatter
  ids = jnp.sum(jnp.where(to_JxJ, ids_J[None, :], 0), axis=1)
  slots = jnp.sum(jnp.where(to_JxJ, slots_J[None, :], 0), axis=1)
  n = jnp.sum(valid).astype(jnp.int32)
  # slot buffers that are layer i of stacked ones (the engine's scan): the loop carries
  # the stacks and writes at (i, slot) in place (`layer_view`); the store is read at
  # (i, expert) the same way
  v = layer_view.common(list(buffers.values()))
  layer = None if v is None else v.i
  if mapped and not (pinned or low_bits is not None or isinstance(store, staging.Staged)):
    n = layer_view.will_need([store[name] for name in buffers], ids, n)

  def copy_one(j, bufs):
    bufs = dict(bufs)
    staged = store.rows(ids[j]) if isinstance(store, staging.Staged) else None
    for name, buf in bufs.items():
      buf = buf if layer is None else layer_view.at(buf, layer)
      if staged is not None:   # through the host staging tier (`io.staging`)
        new = resident_lib.write_rows(buf, as_dtype(staged[name], buf.dtype), slots[j])
      elif low_bits is not None:
        new = resident_lib.write_rows(buf, _low_row(store, name, ids[j], buf.dtype, pinned,
                                                    low_bits), slots[j])
      elif not pinned and store[name].dtype.itemsize == buf.dtype.itemsize:
        new = layer_view.copy_row(buf, slots[j], store[name], ids[j])   # one copy, in place
      else:                    # 16-bit floats stay bits from the store to the slot
        row = to_device(layer_view.rows(store[name], ids[j], 1), pinned)
        row = row if row.dtype.itemsize == buf.dtype.itemsize else as_dtype(row, buf.dtype)
        new = resident_lib.write_rows(buf, row, slots[j])
      bufs[name] = new if layer is None else layer_view.stack_at(new, layer)
    return bufs

  if layer is None:
    return jax.lax.fori_loop(0, n, copy_one, dict(buffers))
  out = jax.lax.fori_loop(0, n, copy_one, dict(zip(buffers, v.stacks)))
  return {name: layer_view.at(s, layer) for name, s in out.items()}


def prompt_table(ctx, store: dict, x, dtypes: dict) -> dict:
  """The expert table a prompt pass computes its (token, expert) pairs from.  On the CPU
  backend (a store in the device's own memory) it is the store itself: the routed kernel
  reads the rows it needs in place, 16-bit floats as their bits, so no step holds a copy
  of the layer (Qwen3-30B-A3B: 1.2 GB a layer).  Elsewhere the layer is moved to the
  device, as `dtypes`, for this call only: the plan's transient "prefill" bytes.  (The CPU
  backend without the kernel takes `one_at_a_time` instead: see `reads_one_at_a_time`.)"""
  if not ctx.pinned and cpu_matmul.supports(x, store) and cpu_kernel.available():
    return store
  return {n: as_dtype(to_device(v, ctx.pinned), dtypes[n]) for n, v in store.items()}


def reads_one_at_a_time(ctx, store: dict, x) -> bool:
  """Whether a prompt pass on `store` runs its experts one at a time (`one_at_a_time`):
  on the CPU backend, a store the routed kernel would read in place (plain SwiGLU, the
  plan's no-copy case) when the kernel is off (MOEJAX_CPU_KERNEL=0, or no C++ compiler).
  A table there was XLA's: it converted the whole store and kept it (an 806 MB
  per-expert checkpoint of 4 layers: 1.39 GB of anonymous memory in the prompt pass,
  against 0.39 GB with the kernel); one expert at a time holds one expert."""
  return (not ctx.pinned and jax.default_backend() == "cpu"
          and cpu_matmul.supports(x, store) and not cpu_kernel.available())


def store_prompt_experts(ctx, store: dict, x_PxD, ids_PxK, gates_PxK, dtypes: dict):
  """A prompt's routed experts [P, D] from the store, one expert at a time (`one_at_a_time`;
  16-bit floats sliced as their bits, as `copy_rows` reads them)."""
  num_e = next(iter(store.values())).shape[0]
  rows = lambda e: {n: _row(store[n], e, dtypes[n], ctx.pinned) for n in dtypes}
  return one_at_a_time(ctx, rows, num_e, x_PxD, ids_PxK, gates_PxK)


def staged_prompt_experts(ctx, store: staging.Staged, x_PxD, ids_PxK, gates_PxK, dtypes: dict):
  """A prompt's routed experts [P, D] from a host staging tier (`io.staging`), one expert
  at a time (`one_at_a_time`), each read through the tier.  No table of the layer is
  built: XLA CPU kept every layer's table alive at once (4 x 1.2 GB at 4 real-width
  layers, measured)."""
  rows = lambda e: {n: as_dtype(r, dtypes[n]) for n, r in store.rows(e).items()}
  return one_at_a_time(ctx, rows, store.cache.num_experts, x_PxD, ids_PxK, gates_PxK)


def one_at_a_time(ctx, rows, num_e: int, x_PxD, ids_PxK, gates_PxK):
  """A prompt's routed experts [P, D]: the experts its tokens route to, one at a time
  (rows(e): expert e's tables [1, ...]), each run on every token with that token's gate
  for it (0: not routed)."""
  used_E = jnp.any(ids_PxK.reshape(-1, 1) == jnp.arange(num_e), axis=0)
  order_E = jnp.argsort(~used_E, stable=True).astype(jnp.int32)    # the used ones first
  swiglu = families.of(ctx.cfg).swiglu(ctx.cfg)
  zero_Px1 = jnp.zeros((x_PxD.shape[0], 1), jnp.int32)

  def one(j, y_PxD):
    e = order_E[j]
    w_Px1 = jnp.sum(jnp.where(ids_PxK == e, gates_PxK, 0.0), axis=1, keepdims=True)
    y = experts_lib.apply_experts(x_PxD, zero_Px1, w_Px1.astype(gates_PxK.dtype), rows(e),
                                  swiglu=swiglu)
    return y_PxD + y.astype(jnp.float32)
  y = jax.lax.fori_loop(0, jnp.sum(used_E).astype(jnp.int32), one,
                        jnp.zeros(x_PxD.shape, jnp.float32))
  return y.astype(x_PxD.dtype)


def copy_into_slots(ctx, buffers: dict, store: dict, ids_J, slots_J,
                    low_bits: int | None = None, pinned: bool | None = None) -> dict:
  """`copy_rows` into the layer's slots: on the one device, or expert-parallel on the
  devices that own the slots (ctx: `decode.Ctx`; pinned: the store is in a host memory
  kind, default ctx.pinned)."""
  pinned = ctx.pinned if pinned is None else pinned
  if ctx.ep is None:
    return copy_rows(buffers, store, ids_J, slots_J, pinned, low_bits, ctx.mapped)
  return expert_parallel.copy_rows(ctx.ep, copy_rows, buffers, store, ids_J, slots_J,
                                   pinned="local" if pinned else False, low_bits=low_bits)


def parallel_experts(ctx, x_TxD, rows_TxK, w_TxK, bufs: dict, dtypes: dict | None = None):
  """`expert_parallel.routed_experts` of T tokens: rows in the slots `bufs`; or (dtypes:
  the slot buffers' dtypes) expert ids in the layer's store `bufs`, each device computing
  the experts d, d + N, ... from its replica (the prompt pass)."""
  n, num_e = ctx.ep.devices, ctx.cfg.num_experts
  swiglu = families.of(ctx.cfg).swiglu(ctx.cfg)

  def local(store):
    ids = jnp.minimum(jax.lax.axis_index(expert_parallel.AXIS) + n * jnp.arange(-(-num_e // n)),
                      num_e - 1)
    return {k: as_dtype(jnp.take(to_device(v, "local" if ctx.pinned else False), ids, axis=0),
                        dtypes[k]) for k, v in store.items()}
  return expert_parallel.routed_experts(
      ctx.ep, lambda *a: experts_lib.apply_experts(*a, swiglu=swiglu),
      x_TxD, rows_TxK, w_TxK, bufs, None if dtypes is None else local)


def host_experts(ctx, store: dict, dtypes: dict, moe_in, ids_BxK, gates_BxK, in_place=True):
  """Tokens' HOST experts (gate 0: none) computed from the store where it lives -> [B, D]
  (moe_in: B tokens of D; ids, gates [B, K], or [K] for one): on the CPU backend the
  kernel reads them in place, every row in one call (`cpu_host`); else (or
  in_place=False: launch/bench_host's 'before') each is sliced out as `dtypes` (the slot
  buffers') and run by `apply_experts`."""
  k = ids_BxK.shape[-1]
  ids, gates = ids_BxK.reshape(-1, k), gates_BxK.reshape(-1, k)
  x = moe_in.reshape(ids.shape[0], -1)

  def sliced(x_BxD, ids_BxK, gates_BxK, w):
    nb = ids_BxK.shape[0]
    rows = {name: jnp.concatenate([_row(v, ids_BxK[b, j], dtypes[name], ctx.pinned)
                                   for b in range(nb) for j in range(k)])
            for name, v in w.items()}
    return experts_lib.apply_experts(x_BxD, jnp.arange(nb * k).reshape(nb, k), gates_BxK, rows,
                                     swiglu=families.of(ctx.cfg).swiglu(ctx.cfg))
  if (in_place and not ctx.pinned and cpu_host.supports(x, store) and cpu_kernel.available()
      and all(store[n].dtype.itemsize == jnp.dtype(t).itemsize for n, t in dtypes.items())):
    return cpu_host.host_experts(x, ids, gates, store, sliced)
  if in_place and not ctx.pinned and quant_ops.quantized_keys(store) and cpu_kernel.available():
    # GGUF blocks: the routed kernel reads the experts by id where the store holds them (as
    # the prompt pass does); slicing copied all K experts' blocks, 2.65 MB each in Q4_0
    return experts_lib.apply_experts(x, ids, gates, store,
                                     swiglu=families.of(ctx.cfg).swiglu(ctx.cfg))
  return sliced(x, ids, gates, store)


def run_experts(ctx, mod, p, src: dict, h, moe_in, state, head, carried):
  """The layer's experts and residual from the source -> (x, state) (ctx: `decode.Ctx`,
  head: `cache.step.Head`), for one token or B rows (h [B, 1, D], the decision [B, K]).
  The slots source first makes the copies the cache's metadata already promises, in
  order: the previous token's executed prefetches into their slots and its admissions
  and upgrades (`carried`, its `cache.step.Pending`), this token's prefetches into their
  rows, its fetches (full, then low precision): each expert once, whatever the rows."""
  dec, k = head.dec, ctx.cfg.top_k
  nb = dec.ids.shape[0]
  run = dec.exec_ids
  low_on = ctx.policy.decision.low
  if ctx.source == "table":        # every expert on the device: by id; HOST exact
    if low_on:                     # a low-precision resident: its dequantised copy
      e = jnp.maximum(run, 0)
      low = (run >= 0) & state.low[e] & (state.expert_slot[e] >= 0)
      run = jnp.where(low, run + ctx.cfg.num_experts, run)
    run = jnp.where(dec.action == HOST, dec.ids, run)
    w = jnp.where(run >= 0, dec.weights, 0.0)
    x = mod.apply({"params": p}, h, moe_in, jnp.maximum(run, 0).reshape(nb, 1, k),
                  w.reshape(nb, 1, k), src["table"], method="moe_residual")
    return x, state
  store, bufs = src["store"], state.buffers
  num_p = state.slot_expert.shape[0]
  if not ctx.all_resident:         # nothing to copy when every expert stays resident
    # the previous token's kept prefetches and admissions (in the order its tail
    # inserted them), then this token's prefetches into their rows and its fetches
    ids = [carried.admissions, head.fetched]
    slots = [carried.admission_slots, head.fetch_slots]
    if ctx.spec_on:
      ids, slots = [carried.kept] + ids, [carried.kept_slots] + slots
      pf_rows = jnp.where(head.pf_ids >= 0, num_p + 1 + jnp.arange(k), -1)   # `prefetch.view`
      bufs = copy_rows(bufs, store, head.pf_ids, pf_rows.astype(jnp.int32), ctx.pinned,
                       mapped=ctx.mapped)
    if low_on:                     # this token's low fetches come from the low store
      slots[-1] = jnp.where(head.fetch_low, -1, head.fetch_slots)
    bufs = copy_into_slots(ctx, bufs, store, jnp.concatenate(ids), jnp.concatenate(slots))
    if low_on:
      bufs = copy_into_slots(ctx, bufs, src["low"], head.fetched,
                             jnp.where(head.fetch_low, head.fetch_slots, -1),
                             ctx.policy.decision.low_bits)
    state = dataclasses.replace(state, buffers=bufs)
  w = jnp.where(head.rows.reshape(nb, k) >= 0, dec.weights, 0.0)
  if ctx.ep is not None:           # each device its own slots' experts, then a psum
    y = parallel_experts(ctx, moe_in.reshape(nb, -1), head.rows.reshape(nb, k), w, bufs)
    x = mod.apply({"params": p}, h, moe_in, y.reshape(h.shape), method="add_routed")
  else:
    x = mod.apply({"params": p}, h, moe_in, jnp.maximum(head.rows, 0).reshape(nb, 1, k),
                  w.reshape(nb, 1, k), bufs, method="moe_residual")
  if ctx.policy.decision.host or nb > 1:   # read where the store lives: HOST experts, and
    # (rows decoded together) an expert fetched for the step that found every slot held
    # by an expert the step executes: used from the store, not kept (docs/design.md)
    host = dec.action == HOST
    spill = (head.rows.reshape(nb, k) < 0) & (dec.exec_ids >= 0) & ~host
    wh = jnp.where(host | spill, dec.weights, 0.0)
    e = jnp.where(host, dec.ids, jnp.where(spill, dec.exec_ids, 0))
    dtypes = {n: b.dtype for n, b in bufs.items()}
    y = host_experts(ctx, store, dtypes, moe_in, e, wh)     # every row in one call
    x = x + y.reshape(x.shape).astype(x.dtype)
  return x, state
