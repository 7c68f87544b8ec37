"""A token (or a prompt) through every layer, and the engine's programs over it.

The pure functions (`decode_token`, `prompt_pass`, `empty_carry`) take one stream through
every layer on one expert source.  The emulator vmaps them over streams with the `table`
source (every expert on the device); the engine jits them for one stream with the `slots`
source (slot buffers and in-program copies from the host store).  Both run the same
`layer.decode_layer` and the same tails (`cache.step.policy_tails`, every MoE layer's at
once after the last layer).  Carry of a stream: a `layer_stack.Carry` (KV cache, every MoE
layer's ResidentState, its `layer.LayerCarry`), per layer (stacked [L, ...] for a uniform
model under `scan`, else lists/dicts over layers).

The engine's programs (`step_fn`: a decode step, `loop`: N steps in one while_loop,
`prefill`: a prompt) are each ONE jitted program over explicit pytrees (the parameters,
each MoE layer's source: its host store arrays and predictors, the carry), with the carry
donated.  Inside, waited fetches, admissions and prefetches are in-program copies from the
host store into the slot buffers (`sources.copy_rows`).  The host's only per-token work is
the dispatch and, when it wants them, reading the token's decisions: the step's
`cache.step.Record` crosses the program boundary packed into one array (`pack`), read back
on the host by the program's `RecordLayout` (`record_layout`, known when it is built).
`Program` (hashable) is the static part: the layer context, dtype and cache length.
Compiles: one per program and argument shapes (one per prompt bucket
for `prefill`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import resident as resident_lib
from moejax.cache import step as step_lib
from moejax.io import staging
from moejax.model import families, layer_stack, routing
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer, init_cache
from moejax.model.sampler import bucket, sample_loop
from moejax.offload import layer as layer_lib
from moejax.offload import sources


# ------------------------------------------------------------------ a token, a prompt
def empty_carry(ctx: layer_lib.Ctx, dtype, max_len: int, states, scan: bool,
                rows: int = 1) -> layer_stack.Carry:
  """The `layer_stack.Carry` of a new stream (or of `rows` decoded together, sharing the
  states), laid out for `layer_stack.run_layers`."""
  cfg = ctx.cfg
  cache = init_cache(cfg, rows, max_len, dtype)
  carried = {l: layer_lib.LayerCarry.none(cfg, rows) for l in cfg.moe_layers}
  if scan and layer_stack.uniform(cfg):
    stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
    return layer_stack.Carry(stack(cache), states, stack([carried[l] for l in cfg.moe_layers]))
  return layer_stack.Carry(cache, states, carried)


def _apply(mod, p, *args, method):
  return mod.apply({"params": p}, *args, method=method)


def decode_token(ctx: layer_lib.Ctx, dtype, params, layers, srcs, carry, token, pos, key,
                 scan: bool, whole: bool = False, valid_B=None):
  """One decoded token of one stream -> (carry, logits [V], `cache.step.Record` stacked
  over MoE layers).  whole: the engine's scan (`layer_stack.scan_whole`).  Rows decoded
  together (token, pos: [B], each row at its own position; valid_B: the active rows):
  one batched step per MoE layer on the shared states -> logits [B, V], the Record's
  per-token fields [L, B K]."""
  cfg = ctx.cfg
  model = Transformer(cfg, dtype)
  x = model.apply({"params": params}, token.reshape(-1, 1), method="embed")
  stream = layer_lib.Stream.start(x, cfg, dtype)
  layer_fn = functools.partial(layer_lib.decode_layer, ctx, pos.reshape(-1, 1), key,
                               valid_B=valid_B)
  stream, per_layer, outs = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, srcs, stream,
      layer_stack.zip_carry(cfg, carry, scan=scan), scan=scan, whole=whole)
  logits = model.apply({"params": params}, stream.x[:, -1], method="logits")
  logits = logits if jnp.ndim(token) else logits[0]
  carry, steps = _tails(ctx, layer_stack.unzip_carry(cfg, per_layer, scan=scan), outs.head)
  return carry, logits, step_lib.record(steps, outs.admitted)


_META = ("slot_expert", "expert_slot", "last_used", "loaded", "low", "freq", "acc", "step")


def _tails(ctx: layer_lib.Ctx, carry: layer_stack.Carry, heads):
  """`cache.step.policy_tails` of every MoE layer (their states stacked [L, ...]: a dict
  of them is stacked and split again) -> (carry with the new pending inserts, steps).
  The copies its inserts promise are made by the layer at the next token
  (`sources.run_experts`)."""
  states, carried = carry.states, carry.carried
  rule = ctx.rule
  if not isinstance(states, dict):     # stacked [L, ...] (a uniform model under scan)
    states, steps = step_lib.policy_tails(rule, states, heads)
    return layer_stack.Carry(carry.cache, states,
                             dataclasses.replace(carried, pending=steps.pending)), steps
  moe = ctx.cfg.moe_layers
  meta = resident_lib.ResidentState(buffers={}, **{
      f: jnp.stack([getattr(states[l], f) for l in moe]) for f in _META})
  meta, steps = step_lib.policy_tails(rule, meta, heads)
  states, carried = dict(states), dict(carried)
  for j, l in enumerate(moe):
    states[l] = dataclasses.replace(states[l], **{f: getattr(meta, f)[j] for f in _META})
    pending = jax.tree_util.tree_map(lambda a, j=j: a[j], steps.pending)
    carried[l] = dataclasses.replace(carried[l], pending=pending)
  return layer_stack.Carry(carry.cache, states, carried), steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptRecord:
  """What a prompt did to the cache, per MoE layer (stacked [L, ...])."""
  copied_E: jax.Array      # the experts it made available (-1 padded)
  evicted_EP: jax.Array    # evicted by their insert and the trim [E + P] (-1 padded)


def prompt_pass(ctx: layer_lib.Ctx, dtype, max_len: int, params, layers, srcs, states, tokens_P,
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
      x, cache = _apply(mod, p, x, pos, pl.cache, 0, method=layer_lib.dense)
      return x, dataclasses.replace(pl, cache=cache), None
    h, moe_in, logits, cache = _apply(mod, p, x, pos, pl.cache, 0,
                                      method=layer_lib.attend_route)
    ids, gates, _ = routing.route(cfg, logits.reshape(plen, -1))   # [P, router_width]
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


# ------------------------------------------------------------------ the programs
@dataclasses.dataclass(frozen=True)
class Program:
  """scan: the layers as one scan (`layer_stack.scan_whole`; a uniform model): the
  parameters hold the layers stacked under "layers" (`stack_params`), the sources are one
  stacked tree and the carry is stacked [L, ...]; else every layer is unrolled, over
  lists and dicts per layer."""
  ctx: layer_lib.Ctx
  dtype: str
  max_len: int
  scan: bool = False


def per_layer(prog: Program, moe_layers, states) -> dict:
  """{MoE layer: ResidentState} of states as `prog` takes them (a scanned program's
  stacked [L, ...] ones sliced)."""
  if not prog.scan:
    return states
  return {l: jax.tree_util.tree_map(lambda a, j=j: a[j], states)
          for j, l in enumerate(moe_layers)}


def stack_params(cfg: ModelConfig, params) -> dict:
  """The parameters as a scanned program takes them: the layers' trees stacked [L, ...]
  under "layers" (one copy), the rest as they are."""
  rest = {k: v for k, v in params.items() if not k.startswith("layers_")}
  layers, _ = layer_stack.stack_layers(cfg, params, [None] * cfg.num_layers)
  return dict(rest, layers=layers)


def _layers(prog: Program, params):
  if prog.scan:
    return params["layers"]
  return [params[f"layers_{i}"] for i in range(prog.ctx.cfg.num_layers)]


def _decode(prog: Program, params, srcs, carry, token, pos, valid_B=None):
  ctx = prog.ctx
  carry, logits, records = decode_token(ctx, jnp.dtype(prog.dtype), params,
                                        _layers(prog, params), srcs, carry, token, pos,
                                        jax.random.PRNGKey(0), scan=prog.scan, whole=prog.scan,
                                        valid_B=valid_B)
  return carry, _replicated(prog.ctx, logits), _replicated(prog.ctx, pack(records))


def _replicated(ctx: layer_lib.Ctx, x):
  """Expert-parallel: what the host reads is whole on every device (each process of a
  multi-host run reads its own copy)."""
  return x if ctx.ep is None else jax.lax.with_sharding_constraint(x, ctx.ep.replicated)


@functools.lru_cache(maxsize=None)
def step_fn(prog: Program):
  """The jitted decode step of `prog`: fn(params, srcs, carry, token, pos) -> (carry,
  logits [V], the `cache.step.Record` [L, ...] packed: `pack`), the carry donated; of B
  rows decoded together: fn(params, srcs, carry, tokens [B], pos [B], valid [B]) (a carry
  of `empty_carry(rows=B)`: one compile per B) -> logits [B, V].  One function per program, so a
  call hashes no static argument (the model config's hash is ~25 us a call)."""
  return jax.jit(functools.partial(_decode, prog), donate_argnums=(2,))


@functools.partial(jax.jit, static_argnames=("prog", "bucket_new", "greedy", "nucleus"),
                   donate_argnums=(3,))
def loop(prog: Program, params, srcs, carry, logits, pos, key, n_new, stop_ids, temperature,
         top_p, forced, *, bucket_new: int, greedy: bool, nucleus: bool):
  """`sampler.sample_loop` over the decode step: up to `n_new` sampled (or `forced`)
  tokens in one `while_loop`, as `OffloadEngine.generate`'s per-token path (`sampler.token_loop`).
  -> (carry, tokens [bucket_new] (-1 after the end), count, packed records [bucket_new, L,
  width]: record i is the decode of token i, those from count - 1 on unused)."""
  step = lambda c, tok, p: _decode(prog, params, srcs, c, tok, p)
  carry, toks, n, recs = sample_loop(step, carry, logits, pos, key, n_new, stop_ids,
                                      temperature, top_p, bucket_new=bucket_new,
                                      greedy=greedy, nucleus=nucleus,
                                      record=record_layout(prog, carry.states).packed_like,
                                      forced=forced)
  return carry, _replicated(prog.ctx, toks), _replicated(prog.ctx, n), _replicated(prog.ctx, recs)


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


def fitted(prog: Program, bucket: int) -> Program:
  """`prog` with its KV cache sized to a prompt's bucket: a batch's joining prompt fills
  its row's first positions (`model.put_row`), with no full-length cache to fill and copy."""
  return dataclasses.replace(prog, max_len=bucket)


def compile_prompts(prog: Program, params, srcs, states, prompt_lengths, fit: bool = False):
  """Compiles (runs nothing) `prefill` for the bucket of each of `prompt_lengths` (fit:
  its `fitted` program)."""
  for t in sorted({min(int(t), prog.max_len - 1) for t in prompt_lengths if t >= 1}):
    p = prompt_bucket(prog, t)
    prefill.lower(fitted(prog, p) if fit else prog, params, srcs, states,
                  np.zeros((p,), np.int32), np.int32(t), np.float32(1.0)).compile()


# ------------------------------------------------------------------ the record, packed
def pack(rec):
  """A step's `Record` [L, ...] as ONE f32 array [L, width] at the program boundary: a
  CPU step pays a fixed cost per output buffer (14 fields: the demo's all-resident engine
  ran at 0.66x the speed of one packed output).  The fields follow the Record's own
  order, and `RecordLayout.unpack` takes their widths from its abstract value, so no field
  order or offset is written down twice.  Ids, slots and counts are small integers: exact
  in f32."""
  leaves = jax.tree_util.tree_leaves(rec)
  return jnp.concatenate([x.astype(jnp.float32) for x in leaves], axis=-1)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
  """What a program's packed step record ([..., L, width], `pack`) was packed from: the
  abstract `cache.step.Record` [L, ...] (`record_layout`), known when the program is
  built, before any step has run."""
  like: step_lib.Record

  @property
  def width(self) -> int:
    return sum(x.shape[-1] for x in jax.tree_util.tree_leaves(self.like))

  @property
  def packed_like(self) -> jax.ShapeDtypeStruct:
    """The abstract packed record [L, width]."""
    return jax.eval_shape(pack, self.like)

  def unpack(self, packed) -> step_lib.Record:
    """`pack`'s inverse on the host: the numpy `Record` (its own arrays, no view keeping
    a device buffer alive) from `packed` [..., L, width]."""
    if np.shape(packed)[-1] != self.width:
      raise ValueError(f"a packed record of width {np.shape(packed)[-1]}, where this "
                       f"program's Record packs to {self.width}: it was made by another program")
    leaves, treedef = jax.tree_util.tree_flatten(self.like)
    out, at = [], 0
    for x in leaves:
      n = x.shape[-1]
      out.append(np.array(packed[..., at:at + n], dtype=x.dtype))
      at += n
    return jax.tree_util.tree_unflatten(treedef, out)


def record_layout(prog: Program, states, rows: int = 1) -> RecordLayout:
  """The `RecordLayout` of `prog`'s step of `rows` rows on `states` (as the program takes
  them; arrays or their shapes): `jax.eval_shape` of the cache's side of the step, which
  alone makes the Record (every MoE layer's `policy_head` on a routing of `rows` tokens,
  then `_tails` and `cache.step.record`): a trace of the cache step, not of the model,
  once per (program, rows, states' shapes) (a server going back to a policy)."""
  leaves, treedef = jax.tree_util.tree_flatten(states)
  shapes = tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves)
  return _record_layout(prog, rows, treedef, shapes)


@functools.lru_cache(maxsize=64)
def _record_layout(prog: Program, rows: int, treedef, leaves) -> RecordLayout:
  ctx, cfg = prog.ctx, prog.ctx.cfg
  moe = cfg.moe_layers
  states = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(*x) for x in leaves])

  def records(states):
    stacked = (resident_lib.ResidentState(buffers={}, **{   # layers may differ in formats:
        f: jnp.stack([getattr(states[l], f) for l in moe]) for f in _META})  # no buffers
               if isinstance(states, dict) else states)
    router = step_lib.route(cfg, jnp.zeros((rows, routing.router_width(cfg)), jnp.float32))
    def head(st):
      _, hd = step_lib.policy_head(ctx.rule, st, router, step_lib.Prediction.none(cfg),
                                   jax.random.PRNGKey(0))
      return hd
    heads = jax.vmap(head)(stacked)
    none = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                  *[layer_lib.LayerCarry.none(cfg, rows) for _ in moe])
    _, steps = _tails(ctx, layer_stack.Carry(None, stacked, none), heads)
    return step_lib.record(steps, none.pending)

  return RecordLayout(jax.eval_shape(records, states))
