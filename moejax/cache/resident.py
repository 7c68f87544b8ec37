"""ResidentState: the device-resident expert cache of one MoE layer, as a pytree.

Nothing about residency lives in Python globals: the state is threaded through
the jitted steps and donated.  Per MoE layer:

  buffers      {name: [P+1, ...]} slot buffers, one per expert-dict key (generic:
               families with biases or quantised blocks add keys); owned device
               arrays, never aliases of host memory.  Row P is scratch: skipped
               insertions write there, so an insertion never reads a buffer
               (and XLA updates it in place); no slot index points at it.
  slot_expert  [P] int32         expert held by each slot (-1 = empty)
  expert_slot  [E] int32         slot of each expert (-1 = not resident)
  last_used    [E] int32         step of the last use on the device (lru); an
                                 insertion counts as a use; -1 = never
  loaded       [E] int32         step of the last insertion (least_stale's FIFO
                                 order within a generation); -1 = never
  low          [E] bool          resident as its low-precision copy (FETCH_LOW; read
                                 only where expert_slot >= 0)
  freq         [E] f32           decayed router-selection count (lfu)
  acc          [E] f32           accumulated normalised share of misses not
                                 waited for (background admission)
  step         [] int32          steps (token-layer decisions) so far

P = S + Z physical slots: S budget slots and Z = max(0, K - S) staging slots, the
fewest that guarantee a token's K experts can be resident at once (an expert in
use by the current token is never evicted for another of the same token).
Staging slots serve the token in flight only: after each token `trim` brings the
resident set back within S, so a budget below K slots really is that small.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import eviction
from moejax.cache import policy as policy_lib
from moejax.kernels import layer_view


class BudgetError(ValueError):
  """A cache budget that cannot work; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class Budget:
  """Slots per MoE layer and what they cost."""
  num_experts: int
  top_k: int
  slots: int              # S: budget slots per layer
  staging: int            # Z: staging slots per layer beyond the budget
  expert_bytes: int
  num_moe_layers: int
  source: str             # how S was derived, for messages
  devices: int = 1        # expert-parallel: S is the union of `devices` x slots_per_device
  slots_per_device: int = 0

  @property
  def physical(self) -> int:
    return self.slots + self.staging

  @property
  def all_resident(self) -> bool:
    return self.slots >= self.num_experts

  @property
  def device_bytes(self) -> int:
    """Expert-cache bytes on each device (the slots, staging and a scratch row)."""
    rows = self.physical if self.devices == 1 else self.slots_per_device
    return (rows + 1) * self.expert_bytes * self.num_moe_layers

  def describe(self) -> str:
    where = ("" if self.devices == 1 else
             f" expert-parallel on {self.devices} devices of {self.slots_per_device} slots each")
    s = (f"{self.slots}/{self.num_experts} experts per layer resident ({self.source}){where}"
         f" + {self.staging} staging slot(s) + 1 scratch row; {self.device_bytes / 1e6:.2f} "
         f"MB of expert cache over {self.num_moe_layers} MoE layers"
         + ("" if self.devices == 1 else " per device"))
    if self.all_resident:
      s += "; the budget holds every expert: all experts are kept resident, nothing is fetched"
    return s

  def as_dict(self) -> dict:
    return dict(slots_per_layer=self.slots, staging_slots_per_layer=self.staging,
                num_experts=self.num_experts, expert_bytes=self.expert_bytes,
                num_moe_layers=self.num_moe_layers, device_bytes=self.device_bytes,
                all_resident=self.all_resident, source=self.source, devices=self.devices,
                slots_per_device=self.slots_per_device or self.slots)


def make_budget(num_experts: int, top_k: int, expert_bytes: int, num_moe_layers: int, *,
                fraction: float | None = 0.25, nbytes: int | None = None,
                streaming: bool = False, devices: int = 1) -> Budget:
  """S = round(fraction * E), or from a device-memory budget in bytes over all MoE layers;
  streaming: no cache (K staging slots emptied after every token).  devices > 1
  (expert-parallel): the fraction or bytes are per device, S is the union of the
  devices' slots (at most E), and it must hold a token's K experts (no staging slots)."""
  if devices > 1:
    one = make_budget(num_experts, top_k, expert_bytes, num_moe_layers, fraction=fraction,
                      nbytes=nbytes, streaming=streaming)
    per = min(one.slots, -(-num_experts // devices))   # slots beyond E would stay empty
    union = min(devices * per, num_experts)
    if streaming or union < top_k:
      raise BudgetError(
          f"--expert_devices={devices} x {per} slots per device hold {union} experts per "
          f"layer, fewer than top_k={top_k} (expert parallelism keeps no staging slots, nor "
          f"streams): raise --cache_fraction / --cache_bytes or the device count")
    return dataclasses.replace(one, slots=union, staging=0, devices=devices,
                               slots_per_device=per,
                               source=f"{one.source} per device")
  if streaming:
    return Budget(num_experts, top_k, 0, top_k, expert_bytes, num_moe_layers,
                  "streaming: no expert kept across tokens")
  if nbytes is not None:
    if nbytes <= 0:
      raise BudgetError(f"--cache_bytes must be positive, got {nbytes}")
    slots = int(nbytes // (expert_bytes * max(1, num_moe_layers)))
    source = f"{nbytes} bytes"
    if slots < 1:
      raise BudgetError(
          f"--cache_bytes={nbytes} holds {slots} expert slots per layer; at least one slot per "
          f"MoE layer is needed ({expert_bytes * num_moe_layers} bytes for "
          f"{num_moe_layers} layers of {expert_bytes}-byte experts)")
  else:
    if fraction is None or not 0.0 < fraction <= 1.0:
      raise BudgetError(f"--cache_fraction must be in (0, 1], got {fraction}")
    slots = int(round(fraction * num_experts))
    source = f"fraction {fraction:g}"
    if slots < 1:
      raise BudgetError(
          f"--cache_fraction={fraction:g} of {num_experts} experts rounds to {slots} slots per "
          f"layer; at least one slot is needed (use >= {0.5 / num_experts:.3g})")
  slots = min(slots, num_experts)
  staging = 0 if slots >= num_experts else max(0, top_k - slots)
  return Budget(num_experts, top_k, slots, staging, expert_bytes, num_moe_layers, source)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidentState:
  buffers: dict
  slot_expert: jax.Array
  expert_slot: jax.Array
  last_used: jax.Array
  loaded: jax.Array
  low: jax.Array
  freq: jax.Array
  acc: jax.Array
  step: jax.Array

  @property
  def num_slots(self) -> int:
    return self.slot_expert.shape[0]

  def resident_experts(self) -> list[int]:
    return sorted(int(e) for e in np.asarray(self.slot_expert) if e >= 0)


def init_state(num_experts: int, num_slots: int, expert_spec: dict,
               buffers: bool = True, extra_rows: int = 0) -> ResidentState:
  """An empty cache.  expert_spec: {name: (shape without the expert axis, dtype)}.

  buffers=False gives a state without slot buffers (for tools that only need
  residency: the simulator).  extra_rows: rows after the scratch row (speculative
  prefetch's K rows, `prefetch.view`).
  """
  bufs = ({k: jnp.zeros((num_slots + 1 + extra_rows,) + tuple(shp), dt)
           for k, (shp, dt) in expert_spec.items()} if buffers else {})
  return ResidentState(
      buffers=bufs,
      slot_expert=jnp.full((num_slots,), -1, jnp.int32),
      expert_slot=jnp.full((num_experts,), -1, jnp.int32),
      last_used=jnp.full((num_experts,), -1, jnp.int32),
      loaded=jnp.full((num_experts,), -1, jnp.int32),
      low=jnp.zeros((num_experts,), bool),
      freq=jnp.zeros((num_experts,), jnp.float32),
      acc=jnp.zeros((num_experts,), jnp.float32),
      step=jnp.zeros((), jnp.int32))


def write_rows(buf, rows, at):
  """buf with rows [n, ...] written at row `at` (`lax.dynamic_update_slice`, in place when
  the buffer is donated); rows of a 16-bit float buffer may come as their bits.  16-bit
  floats are written as their uint16 bits: XLA's CPU backend converted a bf16 buffer to
  f32 and back around the update (8 Qwen3-30B-A3B experts into a [129, 1536, 2048]
  buffer: 1.5 s as bf16, 5 ms as bits), in place by a kernel on the CPU
  (`layer_view.update`).  A buffer that is one layer of stacked ones (`layer_view.at`) is
  written there in place."""
  return layer_view.update(buf, rows, (at,) + (0,) * (buf.ndim - 1))


def as_bits(x):
  """16-bit floats as their uint16 bits (slice these: XLA CPU slices a bf16 array by
  converting all of it to f32 first); other arrays unchanged."""
  if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.bitcast_convert_type(x, jnp.uint16)
  return x


def insert(state: ResidentState, ids_J: jax.Array, rows_J: dict, in_use_E: jax.Array,
           params: policy_lib.CacheParams | policy_lib.PolicyParams, low_J=None):
  """Inserts experts ids_J[j] (with weights {name: rows_J[name][j]}) in order; pure and
  jittable.  rows_J holds one stacked array [>= J, ...] per buffer; None updates the
  metadata only (the engine's decode step copies rows itself: `sources.copy_rows`).

  The j-th insertion overwrites the j-th slot of `eviction.eviction_order` (empty
  first, else per eviction policy): never the slot of an expert marked in
  `in_use_E` nor of one inserted earlier in this call.  Skips ids < 0, repeats
  and experts already resident, and insertions when every slot is protected.
  Rows are written with `lax.dynamic_update_slice` (in place when the state is
  donated).  Returns (state, evicted_J): the expert each insertion evicted (-1:
  none, or the insertion was skipped).  low_J: [J] bool, the inserted experts are
  low-precision copies (`ResidentState.low`; default: full precision).
  """
  num_e = state.expert_slot.shape[0]
  num_s = state.slot_expert.shape[0]
  slot_e, exp_s = state.slot_expert, state.expert_slot
  ids = ids_J.astype(jnp.int32)
  ec = jnp.clip(ids, 0, num_e - 1)
  j = jnp.arange(ids.shape[0])
  first = jnp.all((ids[:, None] != ids[None, :]) | (j[None, :] >= j[:, None]), axis=1)
  want = (ids >= 0) & (exp_s[ec] < 0) & first          # not resident, first occurrence
  rank = policy_lib.prefix_count(want) - 1
  protected = (slot_e >= 0) & in_use_E[jnp.maximum(slot_e, 0)]
  order, usable = eviction.eviction_order(state, protected, params)
  valid = want & (rank < usable)
  slot = order[jnp.clip(rank, 0, num_s - 1)]
  old = jnp.where(valid, slot_e[slot], -1)
  # one-hot compares, not scatters (XLA CPU runs each scatter as a loop of its own):
  # valid insertions have distinct experts, not resident, and distinct slots
  e_E, s_S = jnp.arange(num_e), jnp.arange(num_s)
  ins_JxE = valid[:, None] & (ec[:, None] == e_E)
  got_E = jnp.any(ins_JxE, axis=0)
  gone_E = jnp.any((old[:, None] >= 0) & (old[:, None] == e_E), axis=0)
  exp_s = jnp.where(got_E, jnp.sum(jnp.where(ins_JxE, slot[:, None], 0), axis=0),
                    jnp.where(gone_E, -1, exp_s)).astype(jnp.int32)
  ins_JxS = valid[:, None] & (slot[:, None] == s_S)
  slot_e = jnp.where(jnp.any(ins_JxS, axis=0),
                     jnp.sum(jnp.where(ins_JxS, ec[:, None], 0), axis=0), slot_e).astype(jnp.int32)
  last = jnp.where(got_E, state.step, state.last_used)
  low_E = (jnp.zeros((num_e,), bool) if low_J is None else
           jnp.any(ins_JxE & jnp.asarray(low_J, bool)[:, None], axis=0))
  # one dynamic_update_slice per row and buffer in a fori_loop, in place when donated;
  # a skipped insertion goes to the scratch row.  (Unrolled, XLA CPU fused the chain of
  # updates at computed rows into one loop over the whole buffer: 4 s for 8
  # Qwen3-30B-A3B experts into a 128-slot layer, against 0.05 s in the loop.)
  bufs = dict(state.buffers)
  if rows_J is not None and ids.shape[0]:
    src = {k: as_bits(v.astype(bufs[k].dtype)) for k, v in rows_J.items()}
    at_J = jnp.where(valid, slot, num_s)
    bufs = jax.lax.fori_loop(0, ids.shape[0], lambda jj, b: {
        k: write_rows(buf, jax.lax.dynamic_slice_in_dim(src[k], jj, 1), at_J[jj])
        for k, buf in b.items()}, bufs)
  new_state = dataclasses.replace(state, buffers=bufs, slot_expert=slot_e, expert_slot=exp_s,
                                  last_used=last,
                                  loaded=jnp.where(got_E, state.step, state.loaded),
                                  low=jnp.where(got_E, low_E, state.low))
  return new_state, old.astype(jnp.int32)


def trim(state: ResidentState, budget_slots: int,
         params: policy_lib.CacheParams | policy_lib.PolicyParams, protected_S=None):
  """Evicts experts until at most `budget_slots` are resident (pure, jittable).

  Run after each token on a layer with staging slots (S < K): staging slots hold
  the token in flight only, so the resident set is back within the budget S.
  The experts removed are the first of `eviction.eviction_order` (lru: oldest use;
  lfu: smallest decayed count; least_stale: oldest use, then oldest load; ties by
  lowest slot), the `protected_S` slots last (the token's admissions).
  Slot rows are not cleared (an empty slot's row is never read).  Returns
  (state, evicted_P): the expert each slot lost (-1: none).
  """
  num_e = state.expert_slot.shape[0]
  num_s = state.slot_expert.shape[0]
  slot_e = state.slot_expert
  excess = jnp.sum(slot_e >= 0) - budget_slots
  prot = jnp.zeros((num_s,), bool) if protected_S is None else protected_S
  rank, _ = eviction.eviction_rank(state, prot, params)
  num_empty = jnp.sum(slot_e < 0)
  evict = (slot_e >= 0) & (rank >= num_empty) & (rank < num_empty + excess)
  old = jnp.where(evict, slot_e, -1)
  gone_E = jnp.any(evict[:, None] & (slot_e[:, None] == jnp.arange(num_e)), axis=0)
  exp_s = jnp.where(gone_E, -1, state.expert_slot)
  new_state = dataclasses.replace(state, slot_expert=jnp.where(evict, -1, slot_e),
                                  expert_slot=exp_s)
  return new_state, old.astype(jnp.int32)


insert_jit = jax.jit(insert, static_argnames=("params",), donate_argnums=(0,))
trim_jit = jax.jit(trim, static_argnames=("budget_slots", "params"), donate_argnums=(0,))
