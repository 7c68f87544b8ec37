"""A whole token (or prompt) through every layer, on one expert source: pure functions.

The emulator vmaps these over streams with the `table` source (every expert on the
device); the engine jits them for one stream with the `slots` source (slot buffers
and in-program copies from the host store).  Both run the same `layer.moe_layer`.

Carry of a stream: (KV cache, every MoE layer's ResidentState, pending), per layer
(stacked [L, ...] for a uniform model under `scan`, else lists/dicts over layers); a
MoE layer's pending is its admissions requested at the previous token [K] (with
prefetch: also its true router logits at the previous token and whether there was one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.model import layer_stack, routing
from moejax.model.model import Transformer, init_cache
from moejax.offload import layer as layer_lib
from moejax.offload import sources
from moejax.cache import resident as resident_lib


def empty_pending(ctx: layer_lib.Ctx):
  """A MoE layer's pending at the start of a stream."""
  adm = layer_lib.no_pending(ctx.cfg.top_k)
  if not ctx.spec_on:
    return adm
  return adm, jnp.zeros((1, routing.router_width(ctx.cfg)), jnp.float32), jnp.bool_(False)


def empty_carry(ctx: layer_lib.Ctx, dtype, max_len: int, states, scan: bool):
  """(cache, states, pending) of a new stream, laid out for `layer_stack.run_layers`."""
  cfg = ctx.cfg
  cache = init_cache(cfg, 1, max_len, dtype)
  pend = {l: empty_pending(ctx) for l in cfg.moe_layers}
  if scan and layer_stack.uniform(cfg):
    stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
    return stack(cache), states, stack([pend[l] for l in cfg.moe_layers])
  return cache, states, pend


def _apply(mod, p, *args, method):
  return mod.apply({"params": p}, *args, method=method)


def decode(ctx: layer_lib.Ctx, dtype, params, layers, srcs, carry, token, pos, key, scan: bool):
  """One decoded token of one stream -> (carry, logits [V], (Step, admitted)) stacked over
  MoE layers (`layer.moe_layer`)."""
  cfg = ctx.cfg
  model = Transformer(cfg, dtype)
  x = model.apply({"params": params}, token.reshape(1, 1), method="embed")
  pos_11 = pos.reshape(1, 1)
  if ctx.spec_on:   # (x, r and d of the previous MoE layer, whether there was one)
    x = (x, jnp.zeros((1, cfg.hidden_size), dtype), jnp.zeros((cfg.hidden_size,), jnp.float32),
         jnp.bool_(False))

  def layer_fn(mod, sparse, p, src, x, pl, i):
    cache, state, pending = pl
    if not sparse:
      xin = x[0] if ctx.spec_on else x
      xd, cache = _apply(mod, p, xin, pos_11, cache, pos, method=layer_lib.dense)
      return ((xd,) + x[1:] if ctx.spec_on else xd), (cache, state, pending), None
    x, cache, state, pending, step = layer_lib.moe_layer(
        ctx, mod, p, src, x, pos_11, cache, state, pending, jax.random.fold_in(key, i))
    return x, (cache, state, pending), step

  x, per_layer, steps = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, srcs, x, layer_stack.zip_carry(cfg, *carry, scan=scan),
      scan=scan)
  x = x[0] if ctx.spec_on else x
  logits = model.apply({"params": params}, x[:, -1], method="logits")[0]
  carry = layer_stack.unzip_carry(cfg, per_layer, scan=scan)
  if ctx.defer_tail:
    carry, steps = _tails(ctx, carry, steps)
  return carry, logits, steps


_META = ("slot_expert", "expert_slot", "last_used", "loaded", "low", "freq", "acc", "step")


def _slots(states) -> int:
  return next(iter(states.values())).slot_expert.shape[0]


def _tails(ctx: layer_lib.Ctx, carry, outs):
  """`layer.policy_tail` of every MoE layer at once (vmapped over their stacked
  metadata: one set of small ops per token instead of one per layer), after the last
  layer.  The copies its inserts promise are made by the layer at the next token
  (`sources.run_experts`).  Unrolled carries only (dicts over layers)."""
  cache, states, pending = carry
  heads, admitted = outs
  if ctx.all_resident:    # nothing can change: no usage counts kept (nothing is evicted)
    none = jnp.full(heads.fetched.shape, -1, jnp.int32)
    ev = jnp.full(heads.fetched.shape[:1] + (ctx.cfg.top_k + _slots(states),), -1, jnp.int32)
    return carry, (layer_lib.Step(heads, none, none, ev, admitted), admitted)
  moe = ctx.cfg.moe_layers
  meta = resident_lib.ResidentState(buffers={}, **{
      f: jnp.stack([getattr(states[l], f) for l in moe]) for f in _META})
  tail = lambda st, hd: layer_lib.policy_tail(
      ctx.cfg, ctx.policy.decision, ctx.policy.cache, ctx.trim_to, st, hd,
      spec_on=ctx.spec_on, keep=ctx.keep, skip_empty=False)
  meta, steps = jax.vmap(tail)(meta, heads)
  states, pending = dict(states), dict(pending)
  for j, l in enumerate(moe):
    states[l] = dataclasses.replace(states[l], **{f: getattr(meta, f)[j] for f in _META})
    adm = jax.tree_util.tree_map(lambda a: a[j], steps.pending)
    pending[l] = (adm,) + tuple(pending[l][1:]) if ctx.spec_on else adm
  return (cache, states, pending), (steps, admitted)


def prefill(ctx: layer_lib.Ctx, dtype, max_len: int, params, layers, srcs, states, tokens_P,
            length, decay_pow, scan: bool):
  """An exact prompt (the first `length` of tokens_P) of one stream -> (logits [V], carry,
  (experts made available [L, E] (-1 padded), evicted [L, E + P])).  Per MoE layer the
  prompt's experts are computed from the table, or from the store where it lives
  (`sources.prompt_table`; expert-parallel: each device its share), then the missing ones
  it used most are inserted (`prefill_step`)."""
  cfg, pol = ctx.cfg, ctx.policy.cache
  model = Transformer(cfg, dtype)
  k = cfg.top_k
  plen = tokens_P.shape[0]
  valid = (jnp.arange(plen) < length).astype(jnp.float32)
  pos = jnp.arange(plen, dtype=jnp.int32)[None]
  x = model.apply({"params": params}, tokens_P[None], method="embed")

  def layer_fn(mod, sparse, p, src, x, pl, i):
    cache, st, pending = pl
    if not sparse:
      x, cache = _apply(mod, p, x, pos, cache, 0, method=layer_lib.dense)
      return x, (cache, st, pending), None
    h, moe_in, logits, cache = _apply(mod, p, x, pos, cache, 0, method=layer_lib.attend_route)
    ids, gates, _ = routing.route(cfg, logits.reshape(plen, -1))   # [P, router_width]
    if ctx.ep is not None:   # each device its share of the layer's experts, then a psum
      y = sources.parallel_experts(ctx, moe_in.reshape(plen, -1), ids, gates, src["store"],
                                   {n: b.dtype for n, b in st.buffers.items()})
      x = _apply(mod, p, h, moe_in, y.reshape(h.shape), method="add_routed")
    else:   # the table, the store read in place, or the layer on the device for this call
      table = src["table"] if ctx.source == "table" else sources.prompt_table(
          ctx, src["store"], moe_in, {n: b.dtype for n, b in st.buffers.items()})
      x = _apply(mod, p, h, moe_in, ids.reshape(1, plen, k), gates.reshape(1, plen, k), table,
                 method="moe_residual")
    st, copy_ids, copy_slots, evicted = prefill_step(pol, ctx.trim_to, st, ids, valid,
                                                     decay_pow)
    if ctx.source == "slots":   # expert-parallel: each device from its replica of the store
      st = dataclasses.replace(st, buffers=sources.copy_into_slots(
          ctx, st.buffers, src["store"] if ctx.ep else table, copy_ids, copy_slots,
          pinned=None if ctx.ep else False))
    return x, (cache, st, pending), (copy_ids, evicted)

  cache, _, pending = empty_carry(ctx, dtype, max_len, {}, scan)
  x, per_layer, outs = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, srcs, x,
      layer_stack.zip_carry(cfg, cache, states, pending, scan=scan), scan=scan)
  logits = model.apply({"params": params}, jax.lax.dynamic_index_in_dim(x[0], length - 1),
                       method="logits")[0]
  return logits, layer_stack.unzip_carry(cfg, per_layer, scan=scan), outs


def prefill_step(cache, trim_to, state, ids_PxK, valid_P, decay_pow):
  """The cache's side of a prompt at one MoE layer -> (state, copy ids [E], their slots,
  evicted [E + P]): the union of the prompt's experts was available; the missing ones
  are inserted most used first (ties by id) in one insert that never evicts an expert
  the prompt hit; every expert the prompt selected counts as used now; the LFU count
  decays once per prompt token; then the trim back to the budget."""
  num_e = state.expert_slot.shape[0]
  k = ids_PxK.shape[-1]
  counts = jnp.zeros((num_e,), jnp.float32).at[ids_PxK.reshape(-1)].add(jnp.repeat(valid_P, k))
  used = counts > 0
  resident = state.expert_slot >= 0
  missing = used & ~resident
  order = jnp.lexsort((jnp.arange(num_e), -counts, ~missing))
  ordered = jnp.where(missing[order], order, -1).astype(jnp.int32)
  before = state
  state, ev = resident_lib.insert(state, ordered, None, used & resident, cache)
  slots = layer_lib.placed(before, state, ordered)
  state = dataclasses.replace(state, last_used=jnp.where(used, state.step, state.last_used),
                              freq=state.freq * decay_pow + counts, step=state.step + 1)
  ev_trim = jnp.full((state.slot_expert.shape[0],), -1, jnp.int32)
  if trim_to is not None:
    state, ev_trim = resident_lib.trim(state, trim_to, cache)
  return state, ordered, slots, jnp.concatenate([ev, ev_trim])
