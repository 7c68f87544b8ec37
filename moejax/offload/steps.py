"""The engine's jitted steps, per layer kind, and the small host<->device packings.

Per MoE layer and decoded token the engine makes two device calls:

  attend_decide(p, x, tp, cache, state)      attention, router and `policy.decide`;
                                             returns the decision packed for one
                                             small host read (`pack_decision`)
  moe(p, h, moe_in, dec, host_out, state)    the experts from slot indices, then
                                             `policy.update_usage` (and `resident.trim`
                                             on a layer with staging slots)

`insert_attend_decide` is attend_decide preceded by an insert of arrived
background admissions (one dispatch), and `insert` the insert alone; both take
the insert packed by `pack_insert`.  `fused_steps` joins a MoE layer's moe call
with the next MoE layer's (insert +) attend_decide: one dispatch per layer.  Every
function takes its state as arguments (nothing is closed over but the module and the static policy parts), states
and caches are donated, and each is built once per layer *kind* (sparse or
dense, and the family's layer type) and policy part, so compile count does not
grow with depth and policies that share a part share its compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax import routing
from moejax.config import ModelConfig
from moejax.model import DecoderLayer, Transformer
from moejax.offload import policy as policy_lib
from moejax.offload import resident as resident_lib


def layer_kind(cfg: ModelConfig, i: int) -> tuple[bool, str]:
  """Layers of one kind share their jitted steps."""
  lt = cfg.layer_types[i] if cfg.layer_types else ""
  return bool(cfg.sparse_layers[i]), lt


def representative(cfg: ModelConfig, i: int) -> int:
  """The first layer of layer i's kind (the one its kind's steps are built for)."""
  return next(j for j in range(cfg.num_layers) if layer_kind(cfg, j) == layer_kind(cfg, i))


# ------------------------------------------------------------------ packings
class HostDecision(NamedTuple):
  """One token's decision at one layer, as the host reads it."""
  action: np.ndarray    # [K] int32
  ids: np.ndarray       # [K] int32
  exec_ids: np.ndarray  # [K] int32
  weights: np.ndarray   # [K] f32
  gates: np.ndarray     # [K] f32
  admit: np.ndarray     # [E] bool


def pack_decision(dec: policy_lib.Decision) -> jax.Array:
  """[5K + E] f32: action, ids, exec_ids, weights, gates (K each; small ints are
  exact in f32) and the admission mask, for one device->host read."""
  f = lambda a: a.reshape(-1).astype(jnp.float32)
  return jnp.concatenate([f(dec.action[0]), f(dec.ids[0]), f(dec.exec_ids[0]),
                          f(dec.weights[0]), f(dec.gates[0]), f(dec.admit)])


def unpack_decision(packed: np.ndarray, k: int) -> HostDecision:
  action, ids, exec_ids = (packed[j * k:(j + 1) * k].astype(np.int32) for j in range(3))
  return HostDecision(action, ids, exec_ids, packed[3 * k:4 * k], packed[4 * k:5 * k],
                      packed[5 * k:] > 0)


def pack_insert(ids, in_use_E: np.ndarray, rows: int) -> np.ndarray:
  """[rows ids, -1 padded | E in-use mask] int32: one host argument for an insert of
  `ids` (rows: the row bucket, >= len(ids))."""
  ins = np.full(rows + len(in_use_E), -1, np.int32)
  ins[:len(ids)] = ids
  ins[rows:] = in_use_E
  return ins


def unpack_insert(ins: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(ids [rows], in_use [E] bool) of a `pack_insert` array."""
  r = ins.shape[0] - num_experts
  return ins[:r], ins[r:] > 0


# ------------------------------------------------------------------ steps
class LayerSteps(NamedTuple):
  """The jitted functions of one layer kind (see the module docstring)."""
  dense: Callable
  dense_decode: Callable
  prefill_attend: Callable
  prefill_moe: Callable
  attend_decide: Callable | None
  insert_attend_decide: Callable | None
  moe: Callable | None
  insert: Callable | None


class ModelSteps(NamedTuple):
  embed: Callable          # (params, tokens [1, T]) -> x
  head: Callable           # (params, x [1, D]) -> logits [1, V]
  embed_decode: Callable   # (params, [token, position]) -> (x, tp on the device)
  head_decode: Callable    # (params, x [1, 1, D]) -> logits [V]


def _module(cfg: ModelConfig, dtype, layer_idx: int) -> DecoderLayer:
  return DecoderLayer(cfg, bool(cfg.sparse_layers[layer_idx]), dtype, layer_idx)


def _attend_route(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  moe_in, logits = mdl.route_logits(h)
  return h, moe_in, logits, cache


def _dense(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  return mdl.dense_residual(h), cache


def _unpack_tp(tp):
  """The decode step's one small host input [token, position] -> (positions [1,1], end)."""
  return tp[1].reshape(1, 1), tp[1]


def layer_steps(cfg: ModelConfig, dtype, layer_idx: int, decision: policy_lib.DecideParams,
                cache: policy_lib.CacheParams, budget_slots: int | None) -> LayerSteps:
  """The steps of layer `layer_idx`'s kind (built for the first layer of that kind and
  shared by all of them); `budget_slots`: trim to S after each token (a layer with
  staging slots), None: never."""
  rep = representative(cfg, layer_idx)
  base = _base_steps(cfg, dtype, rep)
  if not cfg.sparse_layers[rep]:
    return base
  return base._replace(**_policy_steps(cfg, dtype, rep, decision, cache, budget_slots))


@functools.lru_cache(maxsize=None)
def policy_fns(cfg: ModelConfig, dtype, layer_idx: int, decision: policy_lib.DecideParams,
                cache: policy_lib.CacheParams, budget_slots: int | None) -> dict:
  """The un-jitted attend/decide, insert and moe functions of a layer kind (composed
  into the jitted steps below and into the fused steps of `fused_steps`)."""
  mod = _module(cfg, dtype, layer_idx)
  num_e = cfg.num_experts

  def attend_decide(p, x, tp, kv, state):
    pos, end = _unpack_tp(tp)
    h, moe_in, logits, kv = mod.apply({"params": p}, x, pos, kv, end, method=_attend_route)
    dec = policy_lib.decide(logits.reshape(-1, logits.shape[-1]), state, decision, cfg)
    return h, moe_in, kv, dec, pack_decision(dec)

  def insert(state, ins, rows):
    ids, in_use = unpack_insert(ins, num_e)
    return resident_lib.insert(state, ids, rows, in_use, cache)

  def moe(p, h, moe_in, dec, host_out, state):
    e = dec.exec_ids
    slot = state.expert_slot[jnp.maximum(e, 0)]
    w = jnp.where(e >= 0, dec.weights, 0.0)
    b, t = h.shape[:2]
    y = mod.apply({"params": p}, h, moe_in, slot.reshape(b, t, -1), w.reshape(b, t, -1),
                  state.buffers, method="moe_residual")
    state = policy_lib.update_usage(state, dec, cache)
    evicted = jnp.full((state.slot_expert.shape[0],), -1, jnp.int32)
    if budget_slots is not None:
      state, evicted = resident_lib.trim(state, budget_slots, cache)
    return y + host_out.astype(y.dtype), state, evicted

  return dict(attend_decide=attend_decide, insert=insert, moe=moe)


@functools.lru_cache(maxsize=None)
def _policy_steps(cfg: ModelConfig, dtype, layer_idx: int, decision: policy_lib.DecideParams,
                  cache: policy_lib.CacheParams, budget_slots: int | None) -> dict:
  f = policy_fns(cfg, dtype, layer_idx, decision, cache, budget_slots)

  @functools.partial(jax.jit, donate_argnums=(3, 4))
  def insert_attend_decide(p, x, tp, kv, state, ins, rows):
    state, evicted = f["insert"](state, ins, rows)
    return f["attend_decide"](p, x, tp, kv, state) + (state, evicted)

  return dict(attend_decide=jax.jit(f["attend_decide"], donate_argnums=(3,)),
              insert_attend_decide=insert_attend_decide,
              moe=jax.jit(f["moe"], donate_argnums=(5,)),
              insert=jax.jit(f["insert"], donate_argnums=(0,)))


class FusedSteps(NamedTuple):
  """One call for MoE layer i's experts and MoE layer i+1's attention and decision:

    moe_attend_decide(p, h, moe_in, dec, host_out, state, p_next, tp, kv_next, state_next)
      -> (h', moe_in', kv_next, dec', packed', state, evicted)
    moe_insert_attend_decide(..., state_next, ins, rows)
      -> (h', moe_in', kv_next, dec', packed', state, evicted, state_next, evicted_next)

  the same functions as the separate steps, in the same order (bit-identical
  results), one dispatch and one host read per layer instead of two calls."""
  moe_attend_decide: Callable
  moe_insert_attend_decide: Callable


@functools.lru_cache(maxsize=None)
def _fused(cfg, dtype, rep_i: int, rep_j: int, decision, cache, budget_slots) -> FusedSteps:
  fi = policy_fns(cfg, dtype, rep_i, decision, cache, budget_slots)
  fj = policy_fns(cfg, dtype, rep_j, decision, cache, budget_slots)

  @functools.partial(jax.jit, donate_argnums=(5, 8))     # state_next is only read
  def moe_attend_decide(p, h, moe_in, dec, host_out, state, p_next, tp, kv_next, state_next):
    y, state, evicted = fi["moe"](p, h, moe_in, dec, host_out, state)
    return fj["attend_decide"](p_next, y, tp, kv_next, state_next) + (state, evicted)

  @functools.partial(jax.jit, donate_argnums=(5, 8, 9))
  def moe_insert_attend_decide(p, h, moe_in, dec, host_out, state, p_next, tp, kv_next,
                               state_next, ins, rows):
    y, state, evicted = fi["moe"](p, h, moe_in, dec, host_out, state)
    state_next, ev_next = fj["insert"](state_next, ins, rows)
    return (fj["attend_decide"](p_next, y, tp, kv_next, state_next)
            + (state, evicted, state_next, ev_next))

  return FusedSteps(moe_attend_decide, moe_insert_attend_decide)


def fusable(cfg: ModelConfig, i: int) -> bool:
  """Layer i and layer i+1 are both MoE layers (their calls can be fused)."""
  return i + 1 < cfg.num_layers and bool(cfg.sparse_layers[i] and cfg.sparse_layers[i + 1])


def fused_steps(cfg: ModelConfig, dtype, i: int, decision: policy_lib.DecideParams,
                cache: policy_lib.CacheParams, budget_slots: int | None) -> FusedSteps | None:
  """The fused steps of MoE layer i and layer i+1 (None unless `fusable`), built once
  per pair of layer kinds."""
  if not fusable(cfg, i):
    return None
  return _fused(cfg, dtype, representative(cfg, i), representative(cfg, i + 1), decision,
                cache, budget_slots)


def warm_fused(fs: FusedSteps, st: LayerSteps, p, p_next, x, tp, kv, kv_next, state,
               state_next, zero_x, zero_rows: dict, row_buckets: tuple[int, ...],
               host_rows: bool):
  """Compiles a pair's fused steps on throwaway copies (states untouched; `kv()` and
  `kv_next()` fresh caches of the two layers, donated)."""
  copy = lambda s: jax.tree_util.tree_map(jnp.copy, s)
  h, moe_in, _, dec, _ = st.attend_decide(p, x, tp, kv(), copy(state))
  jax.block_until_ready(fs.moe_attend_decide(p, h, moe_in, dec, zero_x, copy(state), p_next,
                                             tp, kv_next(), copy(state_next)))
  num_e = state.expert_slot.shape[0]
  for r in row_buckets:
    ins = pack_insert([], np.zeros(num_e, bool), r)
    rows = {k: v[:r] for k, v in zero_rows.items()}
    for kind in ([rows, jax.device_get(rows)] if host_rows else [rows]):
      jax.block_until_ready(fs.moe_insert_attend_decide(
          p, h, moe_in, dec, zero_x, copy(state), p_next, tp, kv_next(), copy(state_next), ins,
          kind))


def dense_decode_fn(cfg: ModelConfig, dtype, layer_idx: int) -> Callable:
  """The un-jitted decode step of a dense layer: (p, x, tp, kv) -> (x, kv)."""
  mod = _module(cfg, dtype, layer_idx)

  def dense_decode(p, x, tp, kv):
    pos, end = _unpack_tp(tp)
    return mod.apply({"params": p}, x, pos, kv, end, method=_dense)

  return dense_decode


@functools.lru_cache(maxsize=None)
def _base_steps(cfg: ModelConfig, dtype, layer_idx: int) -> LayerSteps:
  mod = _module(cfg, dtype, layer_idx)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def dense(p, x, pos, kv, end):
    return mod.apply({"params": p}, x, pos, kv, end, method=_dense)

  dense_decode = jax.jit(dense_decode_fn(cfg, dtype, layer_idx), donate_argnums=(3,))

  @functools.partial(jax.jit, donate_argnums=(3,))
  def prefill_attend(p, x, pos, kv, end):
    h, moe_in, logits, kv = mod.apply({"params": p}, x, pos, kv, end, method=_attend_route)
    ids, gates, _ = routing.route(cfg, logits.reshape(-1, logits.shape[-1]))
    return h, moe_in, kv, ids, gates

  @jax.jit
  def prefill_moe(p, h, moe_in, idx, gates, buffers, extra):
    table = {k: jnp.concatenate([buffers[k], extra[k]]) for k in buffers}
    b, t = h.shape[:2]
    return mod.apply({"params": p}, h, moe_in, idx.reshape(b, t, -1), gates.reshape(b, t, -1),
                     table, method="moe_residual")

  return LayerSteps(dense, dense_decode, prefill_attend, prefill_moe, None, None, None, None)


def warm_layer(st: LayerSteps, p, x, tp, kv, state, zero_x, zero_rows: dict,
               row_buckets: tuple[int, ...], host_rows: bool) -> float:
  """Compiles a layer kind's decode steps on throwaway copies (`state` untouched; `kv()`
  a fresh cache, donated); returns one insert's measured seconds (inf: dense)."""
  if st.moe is None:
    jax.block_until_ready(st.dense_decode(p, x, tp, kv()))
    return float("inf")
  copy = lambda: jax.tree_util.tree_map(jnp.copy, state)
  h, moe_in, _, dec, _ = st.attend_decide(p, x, tp, kv(), copy())
  jax.block_until_ready(st.moe(p, h, moe_in, dec, zero_x, copy()))
  num_e = state.expert_slot.shape[0]
  best = float("inf")
  for r in row_buckets:
    ins = pack_insert([], np.zeros(num_e, bool), r)
    rows = {k: v[:r] for k, v in zero_rows.items()}
    # rows come as host stacks (host copies) or device arrays (gathered across groups)
    for kind in ([rows, jax.device_get(rows)] if host_rows else [rows]):
      jax.block_until_ready(st.insert_attend_decide(p, x, tp, kv(), copy(), ins, kind))
      jax.block_until_ready(st.insert(copy(), ins, kind))
    times = []
    for _ in range(5):
      c = copy()
      t0 = time.perf_counter()
      jax.block_until_ready(st.insert(c, ins, rows))
      times.append(time.perf_counter() - t0)
    best = min(best, float(np.median(times[1:])))
  return best


@functools.partial(jax.jit, static_argnames=("decay",), donate_argnums=(0,))
def prefill_usage(state, counts_E, decay: float):
  """Usage statistics after a prompt: every expert it selected counts as used now."""
  used = counts_E > 0
  return dataclasses.replace(state, last_used=jnp.where(used, state.step, state.last_used),
                             freq=state.freq * decay + counts_E, step=state.step + 1)


@functools.lru_cache(maxsize=None)
def model_steps(cfg: ModelConfig, dtype) -> ModelSteps:
  model = Transformer(cfg, dtype)
  embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method="embed"))
  # [token, position] goes in as numpy (a jit argument costs less than a device_put)
  # and comes back as a device array for the layers
  embed_decode = jax.jit(lambda p, tp: (model.apply({"params": p}, tp[:1].reshape(1, 1),
                                                    method="embed"), tp))
  head = jax.jit(lambda p, x: model.apply({"params": p}, x, method="logits"))
  head_decode = jax.jit(lambda p, x: model.apply({"params": p}, x[:, -1], method="logits")[0])
  return ModelSteps(embed, head, embed_decode, head_decode)


def warm_all(cfg: ModelConfig, steps: list, fused: dict, params, x, tp, new_kv, states: dict,
             zero_x, zero_rows, row_buckets, host_rows) -> float:
  """Compiles each layer kind's steps (`warm_layer`) and each kind pair's fused steps
  (`warm_fused`) once, on fresh caches (`new_kv(layer)`) and untouched states.
  -> the fastest insert seen (seconds)."""
  insert_s, done = float("inf"), set()
  for i, st in enumerate(steps):
    if layer_kind(cfg, i) in done:
      continue
    done.add(layer_kind(cfg, i))
    insert_s = min(insert_s, warm_layer(st, params[f"layers_{i}"], x, tp,
                                        functools.partial(new_kv, i), states.get(i), zero_x,
                                        zero_rows, row_buckets, host_rows))
  done = set()
  for i, fs in fused.items():
    if fs is None:
      continue
    key = (representative(cfg, i), representative(cfg, i + 1))
    if key in done:
      continue
    done.add(key)
    warm_fused(fs, steps[i], params[f"layers_{i}"], params[f"layers_{i + 1}"], x, tp,
               functools.partial(new_kv, i), functools.partial(new_kv, i + 1), states[i],
               states[i + 1], zero_x, zero_rows, row_buckets, host_rows)
  return insert_s
