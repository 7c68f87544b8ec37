"""A whole token (or prompt) through every layer, on one expert source: pure functions.

The emulator vmaps these over streams with the `table` source (every expert on the
device); the engine jits them for one stream with the `slots` source (slot buffers
and in-program copies from the host store).  Both run the same `layer.decode_layer`
and the same tails (`cache.step.policy_tails`, every MoE layer's at once after the last
layer).

Carry of a stream: (KV cache, every MoE layer's ResidentState, its `layer.LayerCarry`),
per layer (stacked [L, ...] for a uniform model under `scan`, else lists/dicts over
layers).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moejax.cache import resident as resident_lib
from moejax.cache import step as step_lib
from moejax.io import staging
from moejax.model import layer_stack, routing
from moejax.model.model import Transformer, init_cache
from moejax.offload import layer as layer_lib
from moejax.offload import sources


def empty_carry(ctx: layer_lib.Ctx, dtype, max_len: int, states, scan: bool):
  """(cache, states, carried) of a new stream, laid out for `layer_stack.run_layers`."""
  cfg = ctx.cfg
  cache = init_cache(cfg, 1, max_len, dtype)
  carried = {l: layer_lib.LayerCarry.none(cfg) for l in cfg.moe_layers}
  if scan and layer_stack.uniform(cfg):
    stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
    return stack(cache), states, stack([carried[l] for l in cfg.moe_layers])
  return cache, states, carried


def _apply(mod, p, *args, method):
  return mod.apply({"params": p}, *args, method=method)


def decode(ctx: layer_lib.Ctx, dtype, params, layers, srcs, carry, token, pos, key, scan: bool):
  """One decoded token of one stream -> (carry, logits [V], `cache.step.Record` stacked
  over MoE layers)."""
  cfg = ctx.cfg
  model = Transformer(cfg, dtype)
  x = model.apply({"params": params}, token.reshape(1, 1), method="embed")
  stream = layer_lib.Stream.start(x, cfg, dtype)
  layer_fn = functools.partial(layer_lib.decode_layer, ctx, pos.reshape(1, 1), key)
  stream, per_layer, (heads, admitted) = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, srcs, stream,
      layer_stack.zip_carry(cfg, *carry, scan=scan), scan=scan)
  logits = model.apply({"params": params}, stream.x[:, -1], method="logits")[0]
  carry, steps = _tails(ctx, layer_stack.unzip_carry(cfg, per_layer, scan=scan), heads)
  return carry, logits, step_lib.record(steps, admitted)


_META = ("slot_expert", "expert_slot", "last_used", "loaded", "low", "freq", "acc", "step")


def _tails(ctx: layer_lib.Ctx, carry, heads):
  """`cache.step.policy_tails` of every MoE layer (their states stacked [L, ...]: a dict
  of them is stacked and split again) -> (carry with the new pending inserts, steps).
  The copies its inserts promise are made by the layer at the next token
  (`sources.run_experts`)."""
  cache, states, carried = carry
  rule = ctx.rule
  if not isinstance(states, dict):     # stacked [L, ...] (a uniform model under scan)
    states, steps = step_lib.policy_tails(rule, states, heads)
    return (cache, states, dataclasses.replace(carried, pending=steps.pending)), steps
  moe = ctx.cfg.moe_layers
  meta = resident_lib.ResidentState(buffers={}, **{
      f: jnp.stack([getattr(states[l], f) for l in moe]) for f in _META})
  meta, steps = step_lib.policy_tails(rule, meta, heads)
  states, carried = dict(states), dict(carried)
  for j, l in enumerate(moe):
    states[l] = dataclasses.replace(states[l], **{f: getattr(meta, f)[j] for f in _META})
    pending = jax.tree_util.tree_map(lambda a, j=j: a[j], steps.pending)
    carried[l] = dataclasses.replace(carried[l], pending=pending)
  return (cache, states, carried), steps


def prefill(ctx: layer_lib.Ctx, dtype, max_len: int, params, layers, srcs, states, tokens_P,
            length, decay_pow, scan: bool):
  """An exact prompt (the first `length` of tokens_P) of one stream -> (logits [V], carry,
  (experts made available [L, E] (-1 padded), evicted [L, E + P])).  Per MoE layer the
  prompt's experts are computed from the table, or from the store where it lives
  (`sources.prompt_table`; expert-parallel: each device its share), then the missing ones
  it used most are inserted (`cache.step.prefill_step`)."""
  cfg, rule = ctx.cfg, ctx.rule
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
    elif isinstance(src.get("store"), staging.Staged):   # one expert at a time, no table
      y = sources.staged_prompt_experts(ctx, src["store"], moe_in.reshape(plen, -1), ids, gates,
                                        {n: b.dtype for n, b in st.buffers.items()})
      x = _apply(mod, p, h, moe_in, y.reshape(h.shape), method="add_routed")
      table = src["store"]     # the inserted experts are read through the tier again
    else:   # the table, the store read in place, or the layer on the device for this call
      table = src["table"] if ctx.source == "table" else sources.prompt_table(
          ctx, src["store"], moe_in, {n: b.dtype for n, b in st.buffers.items()})
      x = _apply(mod, p, h, moe_in, ids.reshape(1, plen, k), gates.reshape(1, plen, k), table,
                 method="moe_residual")
    st, copy_ids, copy_slots, evicted = step_lib.prefill_step(rule, st, ids, valid, decay_pow)
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
