"""An engine's starting resident sets: "all" experts, "empty", or a profile's most used.

`fill_layer` decides one layer's set (and, for a state with slot buffers, copies its
experts in); `stacked_buffers` writes the slot buffers of a scanned engine's stacked
states in place, one block of slots at a time, so that they are never held twice.
The engine and the emulator fill the same way (the emulator without buffers).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import policy as policy_lib
from moejax.cache.resident import Budget, ResidentState, as_bits, init_state, insert_jit


def fill(state: ResidentState, expert_ids, get_expert,
         params: policy_lib.CacheParams | policy_lib.PolicyParams,
         chunk: int = 8) -> ResidentState:
  """Loads `expert_ids` (most important first, at most num_slots) from the host.

  get_expert(e) -> {name: host array}.  Used for the initial contents (e.g. the
  most frequently routed experts of a profile run, or every expert).
  """
  ids = [int(e) for e in expert_ids][: state.num_slots]
  if not ids:
    return state
  num_e = state.expert_slot.shape[0]
  put = functools.partial(jax.device_put, device=next(iter(state.slot_expert.devices())))
  for i in range(0, len(ids), chunk):
    part = ids[i:i + chunk]
    per = [get_expert(e) for e in part] if state.buffers else []   # residency only
    rows = {k: np.zeros((chunk,) + v.shape[1:], v.dtype) for k, v in state.buffers.items()}
    for j, r in enumerate(per):
      for k in rows:
        rows[k][j] = np.asarray(r[k], dtype=rows[k].dtype)
    jid = np.asarray(part + [-1] * (chunk - len(part)), np.int32)
    in_use = np.zeros((num_e,), bool)
    in_use[ids[:i]] = True
    state, _ = insert_jit(state, put(jid), put(rows), put(in_use), params)
    # one chunk in flight: queued calls would each hold their staged rows (16 x 75 MB
    # for a Qwen3-30B-A3B layer filled whole)
    jax.block_until_ready(state)
  return state


def profile_order(counts_E) -> list[int]:
  """Experts by routing frequency (desc, ties by id): the profile initial contents."""
  c = np.asarray(counts_E)
  return [int(e) for e in np.lexsort((np.arange(len(c)), -c))]


def stacked_buffers(expert_spec: dict, num_rows: int, slot_experts: list, get_expert,
                    device, chunk: int = 8) -> dict:
  """Slot buffers stacked [L, num_rows, ...] over layers: layer j's slot s holds expert
  slot_experts[j][s]'s rows, get_expert(j, e) -> {name: host array} (zeros where the slot
  is empty and in the rows after the slots).  Written in place a block of `chunk` slots
  at a time, so the buffers are never held twice (stacking filled per-layer buffers
  would hold, for a moment, every resident expert twice)."""
  chunk = min(chunk, num_rows)
  bufs = {k: jnp.zeros((len(slot_experts), num_rows) + tuple(shp), dt, device=device)
          for k, (shp, dt) in expert_spec.items()}
  for j, slot_e in enumerate(slot_experts):
    slot_e = [int(e) for e in np.asarray(slot_e)]
    for s0 in range(0, len(slot_e), chunk):
      s0 = min(s0, num_rows - chunk)
      ids = [slot_e[s] if s < len(slot_e) else -1 for s in range(s0, s0 + chunk)]
      if max(ids) < 0:
        continue
      rows = {k: np.zeros((chunk,) + tuple(shp), dt) for k, (shp, dt) in expert_spec.items()}
      for i, e in enumerate(ids):
        for k, v in (get_expert(j, e).items() if e >= 0 else ()):
          rows[k][i] = np.asarray(v, dtype=rows[k].dtype)
      bufs = _write_block(bufs, jax.device_put(rows, device), j, s0)
      jax.block_until_ready(bufs)    # one block in flight
  return bufs


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_block(bufs, rows, j, s0):
  """bufs with rows [n, ...] at layer j, rows s0.. (in place: donated)."""
  def at(buf, r):   # 16-bit floats as their bits (see `write_rows`)
    start = (j, s0) + (0,) * (buf.ndim - 2)
    out = jax.lax.dynamic_update_slice(as_bits(buf), as_bits(r.astype(buf.dtype))[None], start)
    return jax.lax.bitcast_convert_type(out, buf.dtype)
  return {k: at(b, rows[k]) for k, b in bufs.items()}


def resolve_initial(initial: str, budget: Budget) -> str:
  """"auto" resolved: all experts if the budget holds them, else empty."""
  if initial == "auto":
    return "all" if budget.all_resident else "empty"
  if initial not in ("empty", "all", "profile"):
    raise ValueError(f"initial must be 'auto', 'empty', 'all' or 'profile', got {initial!r}")
  return initial


def fill_layer(state: ResidentState, layer: int, initial: str, budget: Budget, get_expert,
               cache, top_k: int, profile_counts: dict | None = None) -> ResidentState:
  """MoE layer `layer`'s starting resident set (`initial` resolved: "empty", "all", or
  the `profile_counts`' most used: "profile"); get_expert(e) -> {name: host array}
  (not called for a state without slot buffers)."""
  if initial == "empty":
    return state
  if initial == "all":
    order = range(state.expert_slot.shape[0])
  else:
    if profile_counts is None or layer not in profile_counts:
      raise ValueError(f"initial='profile' needs profile counts for MoE layer {layer}")
    order = profile_order(profile_counts[layer])[: budget.slots]
  return fill(state, order, get_expert, cache, chunk=top_k)


def expert_spec(store, layer: int) -> dict:
  """{name: (shape without the expert axis, dtype)} of one MoE layer's experts: each
  layer's own tensors, which differ between layers in a GGUF whose layers mix formats
  (a Q4_K_M file: "down@q6_k" in some layers, "down@q4_k" in others)."""
  return {k: (np.shape(v), jnp.dtype(np.asarray(v).dtype))
          for k, v in store.get(layer, 0).items()}


def engine_states(store, cfg, layers, budget: Budget, initial: str, cache, extra_rows: int,
                  device, stacked: bool, counts: dict | None = None):
  """An engine's starting ResidentStates, on `device`: {MoE layer: state}, or (stacked: a
  scanned engine) one [L, ...] state whose slot buffers `stacked_buffers` writes in place
  once every layer's resident set is decided (every layer's experts then in the same
  tensors); unrolled, each layer's slots hold its own tensors.  extra_rows: rows after the scratch row
  (speculative prefetch's)."""
  specs = {l: expert_spec(store, l) for l in layers}
  if stacked and any(specs[l] != specs[layers[0]] for l in layers):
    raise ValueError("a scanned engine needs every MoE layer's experts in the same tensors; "
                     f"these differ: {sorted({tuple(sorted(s)) for s in specs.values()})}")
  init = lambda l: jax.device_put(init_state(cfg.num_experts, budget.physical, specs[l],
                                             buffers=not stacked, extra_rows=extra_rows), device)
  states = {l: fill_layer(init(l), l, initial, budget, functools.partial(store.get, l), cache,
                          cfg.top_k, counts) for l in layers}
  if not stacked:
    return states
  spec = specs[layers[0]]
  meta = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *states.values())
  return dataclasses.replace(meta, buffers=stacked_buffers(
      spec, budget.physical + 1 + extra_rows, [st.slot_expert for st in states.values()],
      lambda j, e: store.get(layers[j], e), device))
