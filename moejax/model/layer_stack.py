"""The decoder layers as one `lax.scan` (uniform models) or an unrolled loop.

Helpers shared by the emulator's jitted steps: when every layer is sparse and of
one kind (qwen3_moe, mixtral, olmoe) the layers' parameters, expert tables and
per-layer carries (KV cache, ResidentState, pending admissions) are stacked
[L, ...] and the layers run as a scan over one compiled body; other families
keep lists over layers and unroll.  The engine's scan (`scan_whole`) passes the stacked
trees whole and reads layer i of each in place (`kernels.layer_view`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moejax.kernels import layer_view
from moejax.model.config import ModelConfig
from moejax.model.model import DecoderLayer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
  """What a stream carries from token to token: its KV cache, every MoE layer's
  `ResidentState` and what each MoE layer carries to its next token (the engine's
  `offload.decode.LayerCarry`).  Whole: stacked [L, ...] (a uniform model under `scan`),
  else the cache a list over layers and the others {MoE layer: ...}.  One layer's
  (`zip_carry`): its cache, its state and its carried (None: a dense layer)."""
  cache: Any
  states: Any
  carried: Any


def decoder_modules(cfg: ModelConfig, dtype):
  """One DecoderLayer module per layer."""
  return [DecoderLayer(cfg, s, dtype, i) for i, s in enumerate(cfg.sparse_layers)]


def uniform(cfg: ModelConfig) -> bool:
  """Every layer sparse and of one kind: the layers run as a `lax.scan` (one compiled
  layer body instead of one per layer)."""
  kinds = {(cfg.layer_types[i] if cfg.layer_types else "") for i in range(cfg.num_layers)}
  return all(cfg.sparse_layers) and len(kinds) == 1


def stack_layers(cfg: ModelConfig, params, table):
  """(layers, table) as the jitted functions take them: stacked [L, ...] for uniform
  models, else lists over layers."""
  layers = [params[f"layers_{i}"] for i in range(cfg.num_layers)]
  if not uniform(cfg):
    return layers, list(table)
  stack = lambda *a: jnp.stack(a)
  return jax.tree_util.tree_map(stack, *layers), jax.tree_util.tree_map(stack, *table)


def stack_states(cfg: ModelConfig, states: dict):
  """{MoE layer: ResidentState} stacked [L, ...] for uniform models, else as given."""
  if not uniform(cfg):
    return states
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[states[l] for l in cfg.moe_layers])


def run_layers(cfg: ModelConfig, dtype, layer_fn, layers, table, x, per_layer,
               scan: bool = True, whole: bool = False):
  """x through every layer: layer_fn(mod, sparse, p, table_l, x, per_layer_l, i) ->
  (x, per_layer_l, out_l), per_layer_l one layer's `Carry`.  per_layer: a `Carry` stacked
  [L, ...] (a uniform model under `scan`) or a list of them (`zip_carry`); returns (x,
  per_layer, outs stacked over MoE layers).  scan=False unrolls
  every model (each layer's state and slot buffers separate arrays, updated in place).
  whole (with scan, a uniform model: the engine): `scan_whole`."""
  mods = decoder_modules(cfg, dtype)
  if scan and whole and uniform(cfg):
    return scan_whole(cfg, dtype, layer_fn, layers, table, x, per_layer)
  if scan and uniform(cfg):
    # the KV cache rides in the loop carry and is updated in place, one layer at a
    # time (as scanned xs/ys it would be copied whole at every layer)
    def body(carry, xs):
      x, cache = carry
      i = xs["i"]
      cache_l = jax.tree_util.tree_map(lambda c: c[i], cache)
      x, new, out = layer_fn(mods[0], True, xs["p"], xs["table"], x,
                             Carry(cache_l, xs["states"], xs["carried"]), i)
      cache = jax.tree_util.tree_map(lambda c, n: c.at[i].set(n), cache, new.cache)
      return (x, cache), (new.states, new.carried, out)

    xs = dict(p=layers, table=table, states=per_layer.states, carried=per_layer.carried,
              i=jnp.arange(cfg.num_layers))
    (x, cache), (st, carried, outs) = jax.lax.scan(body, (x, per_layer.cache), xs)
    return x, Carry(cache, st, carried), outs
  per_layer, outs = list(per_layer), []
  for i, mod in enumerate(mods):
    x, per_layer[i], out = layer_fn(mod, cfg.sparse_layers[i], layers[i], table[i], x,
                                    per_layer[i], i)
    if cfg.sparse_layers[i]:
      outs.append(out)
  return x, per_layer, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)


def scan_whole(cfg: ModelConfig, dtype, layer_fn, layers, srcs, x, per_layer):
  """`run_layers` of a uniform model as ONE `lax.scan` whose stacked [L, ...] trees (the
  parameters `layers`, the sources `srcs`, the carry `per_layer`) are passed whole, not
  as the scan's xs: the body reads layer i of each through `layer_view.at`, which the CPU
  kernels read in place (as xs, or sliced, XLA CPU copies each layer's weights, KV cache
  and slot buffers before every custom call).  The carry rides in the loop's carry and is
  written back at i: a stack updated through `layer_view.update` (the KV cache, the slot
  buffers) is already the new stack, in place; any other leaf (small metadata) is set at
  i.  One compiled layer body whatever the depth."""
  mod = decoder_modules(cfg, dtype)[0]

  def body(carry, i):
    x, stacks = carry
    with layer_view.tracing():
      at = lambda t: jax.tree_util.tree_map(lambda a: layer_view.at(a, i), t)
      x, new, out = layer_fn(mod, True, at(layers), at(srcs), x, at(stacks), i)
      return (x, jax.tree_util.tree_map(lambda s, a: _put(s, a, i), stacks, new)), out

  # x as a layer gives it back (parameters in another dtype than x promote it: an
  # unrolled loop changes type after the first layer, a scan's carry cannot)
  floats = lambda t: {a.dtype for a in jax.tree_util.tree_leaves(t)
                      if jnp.issubdtype(a.dtype, jnp.floating)}
  if floats(layers) - floats(x):
    def x_out(c):
      (x_new, _), _ = body(c, jnp.int32(0))
      return x_new
    like = jax.eval_shape(x_out, (x, per_layer))
    x = jax.tree_util.tree_map(lambda a, o: a.astype(o.dtype), x, like)
  (x, per_layer), outs = jax.lax.scan(body, (x, per_layer),
                                      jnp.arange(cfg.num_layers, dtype=jnp.int32))
  return x, per_layer, outs


def _put(stack, leaf, i):
  """The carry's stack after layer i made `leaf`: the stack `leaf` is a view of (updated in
  place), else the stack with `leaf` set at i."""
  s = layer_view.stack_at(leaf, i)
  if s is not None and s.shape == stack.shape and s.dtype == stack.dtype:
    return s
  return stack.at[i].set(leaf)


def zip_carry(cfg: ModelConfig, carry: Carry, scan: bool = True):
  """The carry as `run_layers` takes it: stacked (a uniform model under `scan`) as it
  is, else a list of each layer's `Carry` (a dense layer's states and carried None)."""
  if scan and uniform(cfg):
    return carry
  return [Carry(carry.cache[i], carry.states.get(i), carry.carried.get(i))
          for i in range(cfg.num_layers)]


def unzip_carry(cfg: ModelConfig, per_layer, scan: bool = True) -> Carry:
  """The inverse of `zip_carry`."""
  if scan and uniform(cfg):
    return per_layer
  return Carry([c.cache for c in per_layer],
               {i: c.states for i, c in enumerate(per_layer) if c.states is not None},
               {i: c.carried for i, c in enumerate(per_layer) if c.carried is not None})
