"""The engine's programs: a decode step, N decode steps in one while_loop, a prompt.

Each is ONE jitted program over explicit pytrees (the parameters, each MoE layer's
source: its host store arrays and predictors, the carry: KV cache, ResidentStates,
pending admissions), with the carry donated.  Inside, every layer runs
`layer.moe_layer` on the `slots` source: waited fetches, admissions and prefetches
are in-program copies from the host store into the slot buffers (`sources.copy_rows`).
The host's only per-token work is the dispatch and, when it wants them, reading the
token's decisions (`cache.step.Record`, per MoE layer) to build its record.

`Program` (hashable) is the static part: the layer context, dtype and cache length.
Compiles: one per program and argument shapes (one per prompt bucket for `prefill`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moejax.model.config import ModelConfig
from moejax.offload import layer as layer_lib
from moejax.offload import stats
from moejax.offload import token as token_lib
from moejax.model.sampler import sample_loop


@dataclasses.dataclass(frozen=True)
class Program:
  ctx: layer_lib.Ctx
  dtype: str
  max_len: int


def _layers(cfg: ModelConfig, params):
  return [params[f"layers_{i}"] for i in range(cfg.num_layers)]


def _records(prog: Program, params, srcs, carry, token, pos):
  ctx = prog.ctx
  return token_lib.decode(ctx, jnp.dtype(prog.dtype), params, _layers(ctx.cfg, params), srcs,
                          carry, token, pos, jax.random.PRNGKey(0), scan=False)


def _decode(prog: Program, params, srcs, carry, token, pos):
  carry, logits, records = _records(prog, params, srcs, carry, token, pos)
  packed = stats.pack(records)
  _layouts(prog)[packed.shape] = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), records)
  return carry, _replicated(prog.ctx, logits), _replicated(prog.ctx, packed)


@functools.lru_cache(maxsize=None)
def _layouts(prog: Program) -> dict:
  """{packed shape: the abstract `cache.step.Record`} of `prog`'s steps, noted when a step
  is traced (as part of compiling it: no second trace to learn the record's fields)."""
  return {}


def record_like(prog: Program, packed_shape) -> object:
  """The abstract Record [L, ...] that a packed record of `prog` ([..., L, width]) was
  packed from, which `stats.unpack` reads it with; the step has been traced by then."""
  return _layouts(prog)[tuple(packed_shape[-2:])]


def _replicated(ctx: layer_lib.Ctx, x):
  """Expert-parallel: what the host reads is whole on every device (each process of a
  multi-host run reads its own copy)."""
  return x if ctx.ep is None else jax.lax.with_sharding_constraint(x, ctx.ep.replicated)


@functools.lru_cache(maxsize=None)
def step_fn(prog: Program):
  """The jitted decode step of `prog`: fn(params, srcs, carry, token, pos) -> (carry,
  logits [V], the `cache.step.Record` [L, ...] packed: `stats.pack`), the carry donated.  One function per program, so a
  call hashes no static argument (the model config's hash is ~25 us a call)."""
  return jax.jit(functools.partial(_decode, prog), donate_argnums=(2,))


@functools.partial(jax.jit, static_argnames=("prog", "bucket_new", "greedy", "nucleus"),
                   donate_argnums=(3,))
def loop(prog: Program, params, srcs, carry, logits, pos, key, n_new, stop_ids, temperature,
         top_p, *, bucket_new: int, greedy: bool, nucleus: bool):
  """`sampler.sample_loop` over the decode step: up to `n_new` sampled tokens in one
  `while_loop`, as `OffloadEngine.generate`'s per-token path (`sampler.token_loop`).
  -> (carry, tokens [bucket_new] (-1 after the end), count, packed records [bucket_new, L,
  width]: record i is the decode of token i, those from count - 1 on unused)."""
  step = lambda c, tok, p: _decode(prog, params, srcs, c, tok, p)
  rec = jax.eval_shape(lambda c: step(c, jnp.int32(0), pos)[2], carry)
  carry, toks, n, recs = sample_loop(step, carry, logits, pos, key, n_new, stop_ids,
                                      temperature, top_p, bucket_new=bucket_new,
                                      greedy=greedy, nucleus=nucleus, record=rec)
  return carry, _replicated(prog.ctx, toks), _replicated(prog.ctx, n), _replicated(prog.ctx, recs)


@functools.partial(jax.jit, static_argnames=("prog",), donate_argnums=(3,))
def prefill(prog: Program, params, srcs, states, tokens_P, length, decay_pow):
  """An exact prompt -> (logits [V], carry, (copied ids [L, E], evicted [L, E + P]))."""
  ctx = prog.ctx
  logits, carry, outs = token_lib.prefill(ctx, jnp.dtype(prog.dtype), prog.max_len, params,
                                          _layers(ctx.cfg, params), srcs, states, tokens_P,
                                          length, decay_pow, scan=False)
  return _replicated(ctx, logits), carry, _replicated(ctx, outs)
