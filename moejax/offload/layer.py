"""A decoder layer of a decoded token: attention and router, the prediction
(speculative prefetch), the cache's step (`cache.step.policy_head`), then the experts
from an *expert source* (`sources.run_experts`):

  table   every expert on the device, read by id: the emulator (idealised link);
  slots   the layer's slot buffers, filled by in-program copies from the host store
          (`copy_rows`); HOST experts computed from the store where it lives: the
          engine.

The rest of the cache's step (`policy_tail`) runs for every MoE layer at once after
the last layer (`decode.decode_token`).  The simulator calls `cache.step.policy_step` alone,
on recorded router logits, with the same arguments.

What flows between layers within a token is a `Stream`; what a MoE layer carries to
its next token is a `LayerCarry`.  Both have one type whatever the flags (the prefetch
fields stay unread without speculative prefetch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moejax.cache import policy as policy_lib
from moejax.cache import step as step_lib
from moejax.model import layer_stack
from moejax.model.config import ModelConfig
from moejax.offload.sources import run_experts
from moejax.prefetch import steps as pf

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
