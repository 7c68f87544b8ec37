"""A prompt through every layer (`prompt_pass`), exactly, and the engine's program over it
(`prefill`): per MoE layer the prompt's experts computed from the table or the store, then
the missing ones it used most inserted (`cache.step.prefill_step`).  The decoded tokens
after it are `decode.py`'s."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import step as step_lib
from moejax.io import staging
from moejax.model import families, layer_stack, routing
from moejax.model.model import Transformer
from moejax.model.sampler import bucket
from moejax.offload import sources
from moejax.offload.decode import (Ctx, Program, _layers, _replicated, attend_route, dense,
                                   empty_carry)


def _apply(mod, p, *args, method):
  return mod.apply({"params": p}, *args, method=method)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptRecord:
  """What a prompt did to the cache, per MoE layer (stacked [L, ...])."""
  copied_E: jax.Array      # the experts it made available (-1 padded)
  evicted_EP: jax.Array    # evicted by their insert and the trim [E + P] (-1 padded)


def prompt_pass(ctx: Ctx, dtype, max_len: int, params, layers, srcs, states, tokens_P,
            length, decay_pow, scan: bool, whole: bool = False):
  """An exact prompt (the first `length` of tokens_P) of one stream -> (logits [V], carry,
  `PromptRecord` [L, ...]: the experts made available, those evicted).  Per MoE layer the
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

  def layer_fn(mod, sparse, p, src, x, pl: layer_stack.Carry, i):
    st = pl.states
    if not sparse:
      x, cache = _apply(mod, p, x, pos, pl.cache, 0, method=dense)
      return x, dataclasses.replace(pl, cache=cache), None
    h, moe_in, logits, cache = _apply(mod, p, x, pos, pl.cache, 0,
                                      method=attend_route)
    routed = routing.route(cfg, logits.reshape(plen, -1))          # of [P, router_width]
    ids, gates = routed.ids, routed.gates
    # The bucket's padding positions go to no expert: a pair whose gate is 0 is skipped by
    # the expert kernels, and no valid position reads a later one, so the prompt's own
    # positions keep their bits (a 9-token prompt in a bucket of 16: 7 tokens of experts
    # fewer; a 300-token one in 512: 212).
    gates = gates * valid[:, None]
    if ctx.ep is not None:   # each device its share of the layer's experts, then a psum
      y = sources.parallel_experts(ctx, moe_in.reshape(plen, -1), ids, gates, src["store"],
                                   {n: b.dtype for n, b in st.buffers.items()})
      x = _apply(mod, p, h, moe_in, y.reshape(h.shape), method="add_routed")
    elif (staged := isinstance(src.get("store"), staging.Staged)) or (
        ctx.source != "table" and sources.reads_one_at_a_time(ctx, src["store"], moe_in)):
      # one expert at a time, no table
      dtypes = {n: b.dtype for n, b in st.buffers.items()}
      run = sources.staged_prompt_experts if staged else sources.store_prompt_experts
      y = run(ctx, src["store"], moe_in.reshape(plen, -1), ids, gates, dtypes)
      x = _apply(mod, p, h, moe_in, y.reshape(h.shape), method="add_routed")
      table = src["store"]     # the inserted experts are read from the store (or tier) again
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
    return x, layer_stack.Carry(cache, st, pl.carried), PromptRecord(copy_ids, evicted)

  carry = dataclasses.replace(empty_carry(ctx, dtype, max_len, {}, scan), states=states)
  x, per_layer, outs = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, srcs, x, layer_stack.zip_carry(cfg, carry, scan=scan),
      scan=scan, whole=whole)
  logits = model.apply({"params": params}, jax.lax.dynamic_index_in_dim(x[0], length - 1),
                       method="logits")[0]
  return logits, layer_stack.unzip_carry(cfg, per_layer, scan=scan), outs


@functools.partial(jax.jit, static_argnames=("prog",), donate_argnums=(3,))
def prefill(prog: Program, params, srcs, states, tokens_P, length, decay_pow):
  """An exact prompt -> (logits [V], carry, its `PromptRecord` [L, ...])."""
  ctx = prog.ctx
  logits, carry, outs = prompt_pass(ctx, jnp.dtype(prog.dtype), prog.max_len, params,
                                    _layers(prog, params), srcs, states, tokens_P, length,
                                    decay_pow, scan=prog.scan, whole=prog.scan)
  return _replicated(ctx, logits), carry, _replicated(ctx, outs)


def prompt_bucket(prog: Program, t: int) -> int:
  """The padded length a t-token prompt runs at (a recurrent family: t itself)."""
  if families.of(prog.ctx.cfg).has_recurrent_state(prog.ctx.cfg):
    return t
  return min(bucket(t), prog.max_len)


def buckets(prog: Program, prompt_lengths) -> list[int]:
  """The padded lengths (`prompt_bucket`) prompts of `prompt_lengths` tokens run at, each
  once, a length capped at max_len - 1 (one generated token still fits)."""
  return sorted({prompt_bucket(prog, min(int(t), prog.max_len - 1))
                 for t in prompt_lengths if t >= 1})


def fitted(prog: Program, bucket: int) -> Program:
  """`prog` with its KV cache sized to a prompt's bucket: a batch's joining prompt fills
  its row's first positions (`model.put_row`), with no full-length cache to fill and copy."""
  return dataclasses.replace(prog, max_len=bucket)


def compile_prompt(prog: Program, params, srcs, states, bucket: int, fit: bool = False):
  """`prefill` of a `bucket`-token prompt, lowered and compiled (runs nothing; fit: its
  `fitted` program): the executable takes prefill's arguments after `prog`."""
  return prefill.lower(fitted(prog, bucket) if fit else prog, params, srcs, states,
                       np.zeros((bucket,), np.int32), np.int32(1), np.float32(1.0)).compile()


def compile_prompts(prog: Program, params, srcs, states, prompt_lengths, fit: bool = False):
  """Compiles (runs nothing) `prefill` for the bucket of each of `prompt_lengths` (fit:
  its `fitted` program)."""
  for p in buckets(prog, prompt_lengths):
    compile_prompt(prog, params, srcs, states, p, fit)
