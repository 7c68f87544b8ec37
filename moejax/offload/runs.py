"""Layer runs: the layers of a decode step that need no host work, in one call.

A MoE layer needs the host only when its decision has a FETCH or HOST action or
requests an admission, or when admissions queued at the previous token are due
before its decision.  Every other layer is attention, router, `policy.decide`,
the experts from slots and the usage update: device work the host only counts.
`run` executes layers one after the other in one jitted call and stops where
the host is needed:

  run(params, start, pend_layer, pend, x, tp, caches, metas, buffers, stop_before)
    start       the first layer to run (0: the token's start, its embedding is
                computed here)
    pend_layer  start - 1 when that MoE layer's decision has been served (its moe
                call runs first, with `pend` = (h, moe_in, dec, host_out)), else -1
    x           the input of layer `start` when pend_layer = -1 and start > 0
    tp          [token, position] int32, numpy (the token's one host input)
    stop_before [num MoE layers] bool: layers with admissions due (the host
                inserts them, `SlotWriter.admit`, and decides the layer itself)
  -> RunOut: `info` (one small array for the host: why and where it stopped, the
     decisions of the layers it decided, the moe calls it ran, their evicted ids),
     `logits` (valid when it finished the token), `x`, the stopped layer's
     (h, moe_in, dec), `tp` on the device (for the per-layer steps), and the
     updated caches and ResidentState metadata.

Each layer is a `lax.cond` on "still running and past the pending layer", and
its moe call a nested cond on "needs no host", so skipped layers cost nothing.
The functions are the per-layer steps' own (`steps.policy_fns`,
`steps.dense_decode_fn`), applied in the same order, so outputs, decisions and
records equal the per-layer calls' (`tests/test_engine_runs.py`).  The slot
buffers are read-only here (only inserts write them, in their own calls), so
they are arguments, not carried through the conds; the per-layer metadata and
the caches are donated.  One compile per model, dtype and policy parts.

`straight=True` compiles the run for an engine whose every expert of every layer
is resident (`Budget.all_resident`, filled with all experts): no decision can
fetch, run on the host or admit, so a token's run always goes from its start to
its end.  That run has no conds (each costs the CPU backend tens of microseconds
and passes every layer's state through); it is called only with start 0, no
pending layer and no admissions due, and reports kind AFTER_DECISION at the
first layer whose decision would have needed the host (an engine bug the host
raises on, never serves).
"""

from __future__ import annotations

import collections.abc
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.model import Transformer
from moejax.offload import policy as policy_lib
from moejax.offload import resident as resident_lib
from moejax.offload import steps as steps_lib

FINISHED, AFTER_DECISION, BEFORE_LAYER = 0, 1, 2
META = ("slot_expert", "expert_slot", "last_used", "freq", "acc", "step")


def split_state(state: resident_lib.ResidentState) -> tuple[dict, dict]:
  """(metadata {field: array}, buffers) of a ResidentState."""
  return {f: getattr(state, f) for f in META}, state.buffers


def join_state(meta: dict, buffers: dict) -> resident_lib.ResidentState:
  return resident_lib.ResidentState(buffers=buffers, **meta)


def needs_host(dec: policy_lib.Decision) -> jax.Array:
  """A decision the host must serve: a FETCH or HOST action, or an admission."""
  a = dec.action
  return jnp.any((a == policy_lib.FETCH) | (a == policy_lib.HOST)) | jnp.any(dec.admit)


class RunOut(NamedTuple):
  info: jax.Array       # f32 [2 + 2M + M(5K+E) + M*P]: see `unpack_info`
  logits: jax.Array     # [V]
  x: jax.Array          # the stopped layer's input (BEFORE_LAYER)
  tp: jax.Array         # [token, position] on the device
  h: jax.Array          # the stopped layer's attention output (AFTER_DECISION)
  moe_in: jax.Array
  dec: policy_lib.Decision
  caches: list
  metas: dict


class RunInfo(NamedTuple):
  kind: int                        # FINISHED, AFTER_DECISION or BEFORE_LAYER
  layer: int                       # where it stopped (num_layers: finished)
  decided: list[int]               # MoE layers decided in the call, in order
  packed: dict                     # {layer: its packed decision (steps.pack_decision)}
  moe_ran: list[int]               # MoE layers whose moe call ran
  evicted: dict                    # {layer: evicted ids [P] of its moe call}


def unpack_info(info: np.ndarray, moe_layers, k: int, num_experts: int,
                slots: int) -> RunInfo:
  m, pk = len(moe_layers), 5 * k + num_experts
  kind, layer = int(info[0]), int(info[1])
  decided_m, ran_m = info[2:2 + m] > 0, info[2 + m:2 + 2 * m] > 0
  packs = info[2 + 2 * m:2 + 2 * m + m * pk].reshape(m, pk)
  evs = info[2 + 2 * m + m * pk:].reshape(m, slots).astype(np.int32)
  decided = [l for l, d in zip(moe_layers, decided_m) if d]
  ran = [l for l, r in zip(moe_layers, ran_m) if r]
  return RunInfo(kind, layer, decided, {l: packs[j] for j, l in enumerate(moe_layers)
                                        if decided_m[j]},
                 ran, {l: evs[j] for j, l in enumerate(moe_layers) if ran_m[j]})


def _layer_fns(cfg: ModelConfig, dtype, decision, cache, budget_slots):
  """(MoE layers, their policy functions, the dense layers' decode functions, the model)
  that both runs apply, the per-layer steps' own."""
  rep = lambda i: steps_lib.representative(cfg, i)
  moe_layers = tuple(cfg.moe_layers)
  fns = {l: steps_lib.policy_fns(cfg, dtype, rep(l), decision, cache, budget_slots)
         for l in moe_layers}
  dense = {l: steps_lib.dense_decode_fn(cfg, dtype, rep(l))
           for l in range(cfg.num_layers) if not cfg.sparse_layers[l]}
  return moe_layers, fns, dense, Transformer(cfg, dtype)


@functools.lru_cache(maxsize=None)
def run_fn(cfg: ModelConfig, dtype, decision: policy_lib.DecideParams,
           cache: policy_lib.CacheParams, budget_slots: int | None, straight: bool = False):
  """The jitted `run` of the module docstring for this model, dtype and policy parts
  (`straight`: the all-resident run without conds)."""
  if straight:
    return _straight_run(cfg, dtype, decision, cache, budget_slots)
  moe_layers, fns, dense, model = _layer_fns(cfg, dtype, decision, cache, budget_slots)
  num_layers = cfg.num_layers

  @functools.partial(jax.jit, donate_argnums=(6, 7))
  def run(params, start, pend_layer, pend, x, tp, caches, metas, buffers, stop_before):
    caches, metas = list(caches), dict(metas)
    x = jnp.where(start == 0, model.apply({"params": params}, tp[:1].reshape(1, 1),
                                          method="embed").astype(x.dtype), x)
    ph, pm, pdec, pho = pend
    running, kind, at = jnp.bool_(True), jnp.int32(FINISHED), jnp.int32(num_layers)
    out_h, out_moe_in, out_dec = ph, pm, pdec
    decided, moe_ran, packs, evs = [], [], [], []
    zero_host = jnp.zeros_like(pho)
    for l in range(num_layers):
      p = params[f"layers_{l}"]
      go = running & (l >= start)
      if not cfg.sparse_layers[l]:
        x, caches[l] = jax.lax.cond(go, lambda x, kv, f=dense[l], p=p: f(p, x, tp, kv),
                                    lambda x, kv: (x, kv), x, caches[l])
        continue
      f, bufs, m = fns[l], buffers[l], moe_layers.index(l)
      num_slots = metas[l]["slot_expert"].shape[0]
      no_ev = jnp.full((num_slots,), -1, jnp.int32)

      def moe(meta, h, moe_in, dec, host_out, f=f, p=p, bufs=bufs):
        y, state, ev = f["moe"](p, h, moe_in, dec, host_out, join_state(meta, bufs))
        return y, split_state(state)[0], ev

      is_pend = pend_layer == l
      x, metas[l], ev_pend = jax.lax.cond(
          is_pend, lambda x, meta: moe(meta, ph, pm, pdec, pho),
          lambda x, meta: (x, meta, no_ev), x, metas[l])
      halt = go & stop_before[m]
      kind = jnp.where(halt, BEFORE_LAYER, kind)
      at = jnp.where(halt, l, at)
      running, go = running & ~halt, go & ~halt

      def layer(x, kv, meta, f=f, p=p, bufs=bufs):
        h, moe_in, kv, dec, packed = f["attend_decide"](p, x, tp, kv, join_state(meta, bufs))
        host = needs_host(dec)
        y, meta, ev = jax.lax.cond(host, lambda meta: (x, meta, no_ev),
                                   lambda meta: moe(meta, h, moe_in, dec, zero_host), meta)
        return y, kv, meta, ev, h, moe_in, dec, packed, host

      def skip(x, kv, meta):
        return (x, kv, meta, no_ev, out_h, out_moe_in, out_dec,
                jnp.zeros((5 * cfg.top_k + cfg.num_experts,), jnp.float32), jnp.bool_(False))

      x, caches[l], metas[l], ev, h, moe_in, dec, packed, host = jax.lax.cond(
          go, layer, skip, x, caches[l], metas[l])
      stop = go & host
      kind = jnp.where(stop, AFTER_DECISION, kind)
      at = jnp.where(stop, l, at)
      running = running & ~stop
      pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(stop, a, b),
                                                     new, old)
      out_h, out_moe_in, out_dec = pick(h, out_h), pick(moe_in, out_moe_in), pick(dec, out_dec)
      decided.append(go)
      moe_ran.append(is_pend | (go & ~host))
      packs.append(packed)
      evs.append(jnp.where(is_pend, ev_pend, ev))
    logits = jax.lax.cond(
        running, lambda x: model.apply({"params": params}, x[:, -1], method="logits")[0],
        lambda x: jnp.zeros((cfg.vocab_size,), jnp.float32), x)
    f32 = lambda a: jnp.asarray(a, jnp.float32).reshape(-1)
    info = jnp.concatenate([f32(kind), f32(at), f32(jnp.stack(decided)), f32(jnp.stack(moe_ran)),
                            f32(jnp.stack(packs)), f32(jnp.stack(evs))])
    return RunOut(info, logits.astype(jnp.float32), x, tp + 0, out_h, out_moe_in, out_dec,
                  caches, metas)

  return run


def _straight_run(cfg: ModelConfig, dtype, decision: policy_lib.DecideParams,
                  cache: policy_lib.CacheParams, budget_slots: int | None):
  """`run` for start 0, no pending layer, no admissions due and no layer that needs the
  host (module docstring): the same functions in the same order, without conds.  Its
  metadata comes and goes stacked over the MoE layers (`StateTable.stacked`)."""
  moe_layers, fns, dense, model = _layer_fns(cfg, dtype, decision, cache, budget_slots)

  @functools.partial(jax.jit, donate_argnums=(6, 7))
  def run(params, start, pend_layer, pend, x, tp, caches, stacked, buffers, stop_before):
    del start, pend_layer, stop_before            # 0, -1 and none: the caller's contract
    caches, metas = list(caches), unstack_metas(stacked, moe_layers)
    x = model.apply({"params": params}, tp[:1].reshape(1, 1), method="embed").astype(x.dtype)
    zero_host = jnp.zeros_like(pend[3])   # (None, None, None, zero_x): `straight_pend`
    kind, at = jnp.int32(FINISHED), jnp.int32(cfg.num_layers)
    packs, evs, ones = [], [], []
    for l in range(cfg.num_layers):
      p = params[f"layers_{l}"]
      if not cfg.sparse_layers[l]:
        x, caches[l] = dense[l](p, x, tp, caches[l])
        continue
      f = fns[l]
      h, moe_in, caches[l], dec, packed = f["attend_decide"](p, x, tp, caches[l],
                                                             join_state(metas[l], buffers[l]))
      host = needs_host(dec) & (kind == FINISHED)
      kind, at = jnp.where(host, AFTER_DECISION, kind), jnp.where(host, l, at)
      x, state, ev = f["moe"](p, h, moe_in, dec, zero_host, join_state(metas[l], buffers[l]))
      metas[l] = split_state(state)[0]
      packs.append(packed)
      evs.append(ev)
      ones.append(jnp.bool_(True))
    logits = model.apply({"params": params}, x[:, -1], method="logits")[0]
    f32 = lambda a: jnp.asarray(a, jnp.float32).reshape(-1)
    info = jnp.concatenate([f32(kind), f32(at), f32(jnp.stack(ones)), f32(jnp.stack(ones)),
                            f32(jnp.stack(packs)), f32(jnp.stack(evs))])
    # x, tp and the pending layer's arrays are never read after a straight run (it always
    # finishes the token): not returned, so XLA copies none of them out (11 outputs)
    return RunOut(info, logits.astype(jnp.float32), None, None, None, None, None, caches,
                  stack_metas(metas, moe_layers))

  return run



def placeholders(cfg: ModelConfig, dtype, policy: policy_lib.PolicyParams, budget_slots,
                 params, model_steps, kv, state, zero_x, put):
  """Placeholders (x, (h, moe_in, dec, host_out)) of the right shapes for a run's first
  call of a token (start 0, pend_layer -1: never read); host_out stays numpy, as served."""
  l = cfg.moe_layers[0]
  x, tp = model_steps.embed_decode(params, np.zeros(2, np.int32))
  f = steps_lib.policy_fns(cfg, dtype, steps_lib.representative(cfg, l), policy.decision,
                           policy.cache, budget_slots)
  shapes = jax.eval_shape(f["attend_decide"], params[f"layers_{l}"], x, tp, kv, state)
  h, moe_in, _, dec, _ = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  x0, h, moe_in, dec = put((jnp.zeros_like(x), h, moe_in, dec))
  return x0, (h, moe_in, dec, zero_x)


def warm(run, params, placeholder, states: dict, caches, straight: bool = False):
  """Compiles `run` (the straight one: `straight`) on throwaway copies of the metadata
  (states untouched; `caches` fresh, donated)."""
  if straight:       # stacked as `StateTable.stacked` stacks them (fresh arrays)
    metas = _stack_jit({l: split_state(s)[0] for l, s in states.items()}, tuple(states))
    placeholder = (placeholder[0], straight_pend(placeholder[1]))
  else:
    metas = {l: jax.tree_util.tree_map(jnp.copy, split_state(s)[0]) for l, s in states.items()}
  bufs = {l: s.buffers for l, s in states.items()}
  x0, pend = placeholder
  jax.block_until_ready(run(params, np.int32(0), np.int32(-1), pend, x0, np.zeros(2, np.int32),
                            caches, metas, bufs, np.zeros(len(states), bool)))


def stop_mask(moe_layers, pending: dict) -> np.ndarray:
  """[M] bool: MoE layers with admissions queued (inserted by the host before their
  decision)."""
  return np.asarray([bool(pending[l]) for l in moe_layers], bool)


def restate(states: dict, metas: dict):
  """Writes a run's metadata back into the engine's ResidentStates (buffers kept)."""
  for l, meta in metas.items():
    states[l] = join_state(meta, states[l].buffers)


def straight_pend(pend: tuple) -> tuple:
  """The straight run's `pend`: only the host-output placeholder (its shape and dtype);
  the pending layer's arrays would be 11 buffers of dispatch for nothing."""
  return (None, None, None, pend[3])


def stack_metas(metas: dict, moe_layers) -> dict:
  """{layer: {field: a}} -> {field: [M, ...]} (MoE layers in order)."""
  return {f: jnp.stack([metas[l][f] for l in moe_layers]) for f in META}


def unstack_metas(stacked: dict, moe_layers) -> dict:
  """The inverse of `stack_metas`."""
  return {l: {f: stacked[f][m] for f in META} for m, l in enumerate(moe_layers)}


_stack_jit = jax.jit(stack_metas, static_argnums=1)
_unstack_jit = jax.jit(unstack_metas, static_argnums=1)


class StateTable(collections.abc.MutableMapping):
  """The engine's ResidentStates, {MoE layer: state}, whose metadata the straight run
  keeps stacked over the layers between tokens: 6 arrays in and out of its call instead
  of 6 per layer (on the demo model 96 fewer buffers a call, ~0.1 ms of dispatch on the
  CPU backend).  A layer's state read or written after a straight run unstacks them
  first (one call); `stacked` stacks them (one call) when a per-layer write came last."""

  def __init__(self, states: dict):
    self._states, self._layers = dict(states), tuple(states)
    self._stacked, self._stale = None, False   # stale: the stacked copy is the newer

  def _sync(self):
    if self._stale:
      metas = _unstack_jit(self._stacked, self._layers)
      for l in self._layers:
        self._states[l] = join_state(metas[l], self._states[l].buffers)
      self._stale = False

  def __getitem__(self, l):
    self._sync()
    return self._states[l]

  def __setitem__(self, l, state):
    self._sync()
    self._states[l] = state
    self._stacked = None

  def __delitem__(self, l):
    raise TypeError("the engine's MoE layers are fixed")

  def __iter__(self):
    return iter(self._layers)

  def __len__(self) -> int:
    return len(self._layers)

  def stacked(self) -> dict:
    """The metadata stacked ({field: [M, ...]}), for a straight run that donates it and
    hands back its successor (`set_stacked`)."""
    if self._stacked is None:
      self._stacked = _stack_jit({l: split_state(self._states[l])[0] for l in self._layers},
                                 self._layers)
    out, self._stacked = self._stacked, None   # donated: never handed out twice
    return out

  def set_stacked(self, stacked: dict):
    self._stacked, self._stale = stacked, True

  def buffers(self) -> dict:
    """{layer: slot buffers} (a straight run never changes them: no unstacking)."""
    return {l: self._states[l].buffers for l in self._layers}
