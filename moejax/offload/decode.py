"""One token through every layer, and the engine's programs over it.

A decoder layer of a decoded token (`decode_layer`, `moe_layer`): attention and router, the
prediction (speculative prefetch), the cache's step (`cache.step.policy_head`), then the
experts from an *expert source* (`sources.run_experts`):

  table   every expert on the device, read by id: the emulator (idealised link);
  slots   the layer's slot buffers, filled by in-program copies from the host store
          (`copy_rows`); HOST experts computed from the store where it lives: the
          engine.

The rest of the cache's step (`policy_tail`) runs for every MoE layer at once after the
last layer (`_tails` in `decode_token`).  The simulator calls `cache.step.policy_step`
alone, on recorded router logits, with the same arguments.  What flows between layers
within a token is a `Stream`; what a MoE layer carries to its next token is a
`LayerCarry`.  Both have one type whatever the flags (the prefetch fields stay unread
without speculative prefetch).

`decode_token` takes one stream through every layer on one expert source.  The emulator
vmaps it over streams with the `table` source; the engine jits it for one stream with the
`slots` source.  Carry of a stream: a `layer_stack.Carry` (KV cache, every MoE layer's
ResidentState, its `LayerCarry`), per layer (stacked [L, ...] for a uniform model under
`scan`, else lists/dicts over layers).  A prompt's pass is `offload/prompt.py`.

The engine's programs (`step_fn`: a decode step, `loop`: N steps in one while_loop;
`prompt.prefill`: a prompt) are each ONE jitted program over explicit pytrees (the
parameters, each MoE layer's source: its host store arrays and predictors, the carry),
with the carry donated.  Inside, waited fetches, admissions and prefetches are in-program
copies from the host store into the slot buffers (`sources.copy_rows`).  The host's only
per-token work is the dispatch and, when it wants them, reading the token's decisions: the
step's `cache.step.Record` crosses the program boundary packed into one array
(`record.pack`), read back on the host by the program's `record.RecordLayout`
(`record_layout`, known when it is built).  `Program` (hashable) is the static part: the
layer context, dtype and cache length.  One compile per program and argument shapes.

One token's way (docs/architecture.md, "One token's way"): `api.generate` ->
`engine.OffloadEngine.generate` -> `loop` -> `model.sampler.sample_loop` -> `_decode` ->
`model.layer_stack.run_layers` -> `decode_layer` -> `cache.step.policy_head` (the decision,
`cache.policy.decide`) and `sources.run_experts` (the experts).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from moejax.cache import policy as policy_lib
from moejax.cache import resident as resident_lib
from moejax.cache import step as step_lib
from moejax.model import layer_stack, routing
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer, init_cache
from moejax.model.sampler import sample_loop
from moejax.offload.record import RecordLayout, pack
from moejax.offload.sources import run_experts
from moejax.prefetch import steps as pf


# ------------------------------------------------------------------ a decoder layer
_dataclass = lambda cls: jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@dataclasses.dataclass(frozen=True)
class Ctx:
  """What is static about a layer's step (hashable: part of a jit key)."""
  cfg: ModelConfig
  policy: policy_lib.PolicyParams
  trim_to: int | None                 # budget slots S when there are staging slots
  prefetch: str = "none"              # prefetch.PREFETCH
  speculative: str = "off"
  keep: bool = True                   # executed prefetches enter the cache (False: streaming)
  control: Any = None                 # controls.Control (emulator studies)
  source: str = "table"               # "table" (emulator) | "slots" (engine)
  pinned: bool = False                # the host store is in pinned_host memory
  mapped: bool = False                # the host store is a memory-mapped file (disk tier)
  skip_empty: bool = False            # head inserts under a cond: the CPU backend
  all_resident: bool = False          # every expert resident for good: all hits
  ep: Any = None                      # expert_parallel.Plan: slots over a device mesh

  @classmethod
  def make(cls, cfg: ModelConfig, config, budget, **kw) -> "Ctx":
    """The static part of a layer's step under `config` (an `offload.config.EngineConfig`:
    its policy and prefetch, the engine's and the emulator's alike) with `budget` (a
    `resident.Budget`: staging slots trim back to its S); kw: the other fields by name
    (source, control, pinned, mapped, skip_empty, all_resident, ep)."""
    pf = config.prefetch
    return cls(cfg=cfg, policy=config.policy, trim_to=budget.slots if budget.staging else None,
               prefetch=pf.kind, speculative=pf.speculative, keep=not pf.streaming, **kw)

  @property
  def spec_on(self) -> bool:
    return self.prefetch != "none"

  @property
  def rule(self) -> step_lib.Rule:
    """The cache step's `Rule` (the speculative decision passed in from prefetch)."""
    cfg, decision, speculative = self.cfg, self.policy.decision, self.speculative
    speculate = None
    if self.spec_on:
      speculate = lambda true, pred, seen: pf.speculative_decision(cfg, true, pred, seen,
                                                                   decision, speculative)
    return step_lib.Rule(cfg=cfg, decision=decision, cache=self.policy.cache,
                         trim_to=self.trim_to, keep=self.keep, control=self.control,
                         speculate=speculate, skip_empty=self.skip_empty,
                         all_resident=self.all_resident)


@_dataclass
class Stream:
  """What one token carries from a layer to the next: x [1, 1, D], and for the
  prediction the previous MoE layer's post-attention residual r [1, D], its offset d
  [D] and whether there was one."""
  x: jax.Array
  r_1xD: jax.Array
  d_D: jax.Array
  has: jax.Array

  @classmethod
  def start(cls, x, cfg: ModelConfig, dtype) -> "Stream":
    return cls(x, jnp.zeros((1, cfg.hidden_size), dtype),
               jnp.zeros((cfg.hidden_size,), jnp.float32), jnp.bool_(False))


@_dataclass
class LayerCarry:
  """What a MoE layer carries to its next token: its pending inserts (`Pending`, made
  by its tail) and its true routing at this token (the `previous` predictor's)."""
  pending: step_lib.Pending
  last: step_lib.Prediction

  @classmethod
  def none(cls, cfg: ModelConfig, rows: int = 1) -> "LayerCarry":
    """Nothing pending, for a stream or for `rows` decoded together (B K pending)."""
    return cls(step_lib.Pending.none(cfg.top_k * rows), step_lib.Prediction.none(cfg))


@_dataclass
class LayerOut:
  """What a MoE layer's step of a token leaves for the tails after the last layer
  (`decode.decode_token`): its `Head` (`policy_tail` runs after the last layer and gives
  the new pending inserts) and the Pending this token consumed (inserted at the previous
  token's end: counted here, where it takes effect)."""
  head: step_lib.Head
  admitted: step_lib.Pending


def attend_route(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  moe_in, logits = mdl.route_logits(h)
  return h, moe_in, logits, cache


def dense(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  return mdl.dense_residual(h), cache


def _end(pos_Bx1):
  """The KV-cache end index of B rows: one position (B = 1), or one per row."""
  return pos_Bx1[0, 0] if pos_Bx1.shape[0] == 1 else pos_Bx1[:, 0]


def decode_layer(ctx: Ctx, pos_Bx1, key, mod, sparse: bool, p, src, stream: Stream, per_layer,
                 i, valid_B=None):
  """One layer of one decoded token, or of B rows decoded together (x [B, 1, D], each row
  at its own position, `valid_B` the active ones), as `layer_stack.run_layers` calls it:
  per_layer: the layer's `layer_stack.Carry` (KV cache, ResidentState, LayerCarry) ->
  (stream, per_layer, out): out is None for a dense layer, else its `LayerOut`."""
  if not sparse:
    x, cache = mod.apply({"params": p}, stream.x, pos_Bx1, per_layer.cache, _end(pos_Bx1),
                         method=dense)
    return dataclasses.replace(stream, x=x), dataclasses.replace(per_layer, cache=cache), None
  return moe_layer(ctx, mod, p, src, stream, pos_Bx1, per_layer, jax.random.fold_in(key, i),
                   valid_B)


def moe_layer(ctx: Ctx, mod, p, src: dict, stream: Stream, pos_Bx1, per_layer, key,
              valid_B=None):
  """One MoE layer of one decoded token (or of B rows sharing the layer's cache: one
  batched step, `cache.step.policy_head`) on its `layer_stack.Carry` -> (stream, carry,
  `LayerOut`).  With prefetch (one row only), src has the layer's predictor ("vectors",
  "est", "use_last")."""
  cfg, rule = ctx.cfg, ctx.rule
  state, carried = per_layer.states, per_layer.carried
  apply = lambda *a, method: mod.apply({"params": p}, *a, method=method)
  h, moe_in, logits, cache = apply(stream.x, pos_Bx1, per_layer.cache, _end(pos_Bx1),
                                   method=attend_route)
  lg = logits.reshape(pos_Bx1.shape[0], -1)
  prediction, last = carried.last, carried.last
  if ctx.spec_on:
    hybrid = ctx.prefetch == "hybrid"
    prediction = pf.predicted(cfg, mod, p, ctx.prefetch, src["est"] if hybrid else None,
                              src["use_last"] if hybrid else None, stream.r_1xD, stream.d_D,
                              stream.has, last, lg)
    last = step_lib.Prediction(lg.astype(jnp.float32), jnp.bool_(True))
  state, head = step_lib.policy_head(rule, state, step_lib.route(cfg, lg), prediction, key,
                                     valid_B)
  x, state = run_experts(ctx, mod, p, src, h, moe_in, state, head, carried.pending)
  if ctx.spec_on:
    stream = Stream(x, h.reshape(1, -1), pf.quasi_offset(head.dec.exec_ids[0],
                                                         head.dec.weights[0], src["vectors"]),
                    jnp.bool_(True))
  else:
    stream = dataclasses.replace(stream, x=x)
  return (stream, layer_stack.Carry(cache, state, LayerCarry(carried.pending, last)),
          LayerOut(head, carried.pending))


# ------------------------------------------------------------------ a token
def empty_carry(ctx: Ctx, dtype, max_len: int, states, scan: bool,
                rows: int = 1) -> layer_stack.Carry:
  """The `layer_stack.Carry` of a new stream (or of `rows` decoded together, sharing the
  states), laid out for `layer_stack.run_layers`."""
  cfg = ctx.cfg
  cache = init_cache(cfg, rows, max_len, dtype)
  carried = {l: LayerCarry.none(cfg, rows) for l in cfg.moe_layers}
  if scan and layer_stack.uniform(cfg):
    stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
    return layer_stack.Carry(stack(cache), states, stack([carried[l] for l in cfg.moe_layers]))
  return layer_stack.Carry(cache, states, carried)


def decode_token(ctx: Ctx, dtype, params, layers, srcs, carry, token, pos, key,
                 scan: bool, whole: bool = False, valid_B=None):
  """One decoded token of one stream -> (carry, logits [V], `cache.step.Record` stacked
  over MoE layers).  whole: the engine's scan (`layer_stack.scan_whole`).  Rows decoded
  together (token, pos: [B], each row at its own position; valid_B: the active rows):
  one batched step per MoE layer on the shared states -> logits [B, V], the Record's
  per-token fields [L, B K]."""
  cfg = ctx.cfg
  model = Transformer(cfg, dtype)
  x = model.apply({"params": params}, token.reshape(-1, 1), method="embed")
  stream = Stream.start(x, cfg, dtype)
  layer_fn = functools.partial(decode_layer, ctx, pos.reshape(-1, 1), key,
                               valid_B=valid_B)
  stream, per_layer, outs = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, srcs, stream,
      layer_stack.zip_carry(cfg, carry, scan=scan), scan=scan, whole=whole)
  logits = model.apply({"params": params}, stream.x[:, -1], method="logits")
  logits = logits if jnp.ndim(token) else logits[0]
  carry, steps = _tails(ctx, layer_stack.unzip_carry(cfg, per_layer, scan=scan), outs.head)
  return carry, logits, step_lib.record(steps, outs.admitted)


_META = ("slot_expert", "expert_slot", "last_used", "loaded", "low", "freq", "acc", "step")


def _tails(ctx: Ctx, carry: layer_stack.Carry, heads):
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


# ------------------------------------------------------------------ the programs
@dataclasses.dataclass(frozen=True)
class Program:
  """scan: the layers as one scan (`layer_stack.scan_whole`; a uniform model): the
  parameters hold the layers stacked under "layers" (`stack_params`), the sources are one
  stacked tree and the carry is stacked [L, ...]; else every layer is unrolled, over
  lists and dicts per layer."""
  ctx: Ctx
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


def _replicated(ctx: Ctx, x):
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
                                  *[LayerCarry.none(cfg, rows) for _ in moe])
    _, steps = _tails(ctx, layer_stack.Carry(None, stacked, none), heads)
    return step_lib.record(steps, none.pending)

  return RecordLayout(jax.eval_shape(records, states))
