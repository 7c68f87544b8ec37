"""Exact emulator: the model's outputs under a miss policy, with idealised transfers.

Teacher-forced (or greedy) evaluation of any `PolicyParams` over token streams,
as ONE jitted `lax.scan` over tokens, vmapped over independent streams.  The
carry of each stream is its KV cache plus every MoE layer's `ResidentState`
(and the admissions requested at the previous token).  Per token and MoE layer
the step does what `OffloadEngine.decode_step` does, with zero-time transfers:

  1. insert the layer's admissions requested at the previous token (ascending
     expert id, nothing protected), as the engine does before the layer;
  2. attention + router, then `policy.decide` (the one decision function);
  3. insert the FETCH experts at once (`resident.insert`, the token's executed
     experts protected);
  4. compute the experts: hits and fetches as themselves, substitutes by their
     id with the missed expert's weight, HOST experts as themselves (exact);
  5. `policy.update_usage`; the decision's admission requests are carried to
     the next token.

Every expert's weights are on the device (the full table), so the slot
buffers are not needed: a ResidentState without buffers tracks residency and
an expert is computed from the table by its id, which gives the same numbers
as the engine's slot buffers.

The first tokens of a stream are a prompt, run like `OffloadEngine.prefill`:
exact, the union of the prompt's experts made available and the missing ones
inserted most-used first (ties by id), without evicting an expert the prompt
hit.  A teacher-forced stream uses its first token as a one-token prompt.

Attention context: a stream carries a position per token; position 0 starts a
new attention context (the static KV cache is overwritten from there, stale
entries beyond the current position are masked by causality).  The expert
caches persist across those resets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import quant
from moejax.model.config import ModelConfig
from moejax.model import layer_stack
from moejax.cache.controls import Control  # noqa: F401  (public: emulator.Control)
from moejax.model.layer_stack import stack_layers  # noqa: F401  (public: emulator.stack_layers)
from moejax.prefetch import speculation
from moejax.cache import step as step_lib
from moejax.offload.config import EngineConfig
from moejax.cache import initial as initial_lib
from moejax.cache import resident as resident_lib
from moejax.offload import decode as decode_lib
from moejax.cache.step import STATS  # noqa: F401  (per-token statistics, summed over MoE layers)
from moejax.cache.policy import PolicyParams
from moejax.research import shared_batch
from moejax.research.emulation import (EmulatorError, Emulation, Setup,  # noqa: F401  (public)
                                       decode_chunks, prefill_one, prefill_setup)


# ------------------------------------------------------------------ state
def init_states(cfg: ModelConfig, budget: resident_lib.Budget, policy: PolicyParams,
                initial: str = "auto", profile_counts: dict | None = None) -> dict:
  """Every MoE layer's ResidentState (no slot buffers), filled as the engine fills it."""
  try:
    initial = initial_lib.resolve_initial(initial, budget)
    return {l: initial_lib.fill_layer(
        resident_lib.init_state(cfg.num_experts, budget.physical, {}, buffers=False), l,
        initial, budget, None, policy.cache, cfg.top_k, profile_counts)
        for l in cfg.moe_layers}
  except ValueError as e:
    raise EmulatorError(str(e)) from None


def _token_step(setup: Setup, params, layers, table, carry, token, pos, key):
  """One decoded token of one stream: returns (carry, logits [V], stats, detail)."""
  carry, logits, rec = decode_lib.decode_token(
      setup.ctx, jnp.dtype(setup.dtype), params, layers, table, carry, token, pos, key,
      scan=True)
  stats = step_lib.record_counts(jnp, rec)
  det = {}
  if setup.detail:
    det = dict(action=rec.actions, ids=rec.ids, sub_ids=rec.substitutes, share=rec.share,
               fetched=rec.fetched, admitted=rec.admitted, evicted=rec.evicted,
               admissions=rec.admissions, logits=logits,
               slot_expert=_slot_experts(setup.cfg, carry.states))
  return carry, logits, jnp.sum(stats, axis=0), det


def _slot_experts(cfg: ModelConfig, states):
  """Every MoE layer's slot -> expert map, stacked [L, P]."""
  if layer_stack.uniform(cfg):
    return states.slot_expert
  return jnp.stack([states[l].slot_expert for l in cfg.moe_layers])


# ------------------------------------------------------------------ jitted entry points
def prefill(setup: Setup, params, layers, table, states, tokens_BxP, lengths_B):
  """Exact prompts of B streams (each its own copy of `states`): (logits [B,V], carry).

  The prompt of stream b is tokens_BxP[b, :lengths_B[b]] (the rest is padding).
  """
  lengths_B = np.asarray(lengths_B)
  # the LFU decay over a prompt, lfu_decay ** length, rounded from f64 as the engine's
  decay_B = (float(setup.policy.lfu_decay) ** lengths_B.astype(np.float64)).astype(np.float32)
  return _prefill(prefill_setup(setup), params, layers, table, states, tokens_BxP, lengths_B,
                  decay_B)


@functools.partial(jax.jit, static_argnames=("setup",))
def _prefill(setup: Setup, params, layers, table, states, tokens_BxP, lengths_B, decay_B):
  one = functools.partial(prefill_one, setup, params, layers, table, states)
  return jax.vmap(one)(tokens_BxP, lengths_B, decay_B)


@functools.partial(jax.jit, static_argnames=("setup",), donate_argnums=(4,))
def teacher_forced(setup: Setup, params, layers, table, carry, tokens_BxT, pos_T, targets_BxT,
                   seed_B):
  """Feeds tokens_BxT to B streams; per token its nll of the target.

  Positions pos_T are shared by the streams (a KV-cache write at one index for all;
  per-stream positions would make it a scatter).

  Returns (carry, {"nll": [B,T], "stats": [B,T,len(STATS)], + detail arrays}).
  """
  def one(carry, toks, poss, tgts, seed):
    base = jax.random.PRNGKey(seed)

    def body(c, xs):
      tok, ps, tgt, t = xs
      c, logits, stats, det = _token_step(setup, params, layers, table, c, tok, ps,
                                          jax.random.fold_in(base, t))
      nll = -jax.nn.log_softmax(logits)[tgt]
      return c, dict(nll=nll, stats=stats, **det)

    return jax.lax.scan(body, carry, (toks, poss, tgts, jnp.arange(toks.shape[0])))

  return jax.vmap(one, in_axes=(0, 0, None, 0, 0))(carry, tokens_BxT, pos_T, targets_BxT,
                                                   seed_B)


@functools.partial(jax.jit, static_argnames=("setup", "steps"), donate_argnums=(4,))
def greedy(setup: Setup, params, layers, table, carry, logits_BxV, start_B, steps: int):
  """Greedy continuation of B prompts (after `prefill`): tokens [B, steps] and stats."""
  def one(carry, logits, start):
    def body(c, t):
      cc, lg = c
      tok = jnp.argmax(lg).astype(jnp.int32)
      cc, lg, stats, _ = _token_step(setup, params, layers, table, cc, tok, start + t,
                                     jax.random.PRNGKey(t))
      return (cc, lg), (tok, stats)

    (_, _), (toks, stats) = jax.lax.scan(body, (carry, logits), jnp.arange(steps))
    return toks, stats

  return jax.vmap(one)(carry, logits_BxV, start_B)


# ------------------------------------------------------------------ convenience
def _sources(cfg: ModelConfig, table, preds):
  """Each layer's expert source for `decode.moe_layer`: the table, and the predictors."""
  if layer_stack.uniform(cfg):
    return dict(table=table, **(preds or {}))
  return [None if t is None else dict(table=t, **(preds[i] if preds else {}))
          for i, t in enumerate(table)]


def make(cfg: ModelConfig, params, store, config: EngineConfig = EngineConfig(), *,
         control: Control | None = None, detail: bool = False, stacked: tuple | None = None,
         profile_counts: dict | None = None, low_store=None, batch: int = 1) -> Emulation:
  """An Emulation of the engine's `config` (`offload.config.EngineConfig`, e.g.
  `EngineConfig.make("quality", cache_fraction=0.25, max_len=64)`): its policy, budget
  (cache_fraction or cache_bytes), max_len, dtype, initial contents and prefetch
  (`Prefetch`: the predictor, speculative, its predictors (`prefetch.load_predictors`) and
  streaming; "oracle" is the engine's check only), read as the engine reads them.  Its
  link, timeout, layer_scan and host tier are the engine's alone: here copies take no time.

  The emulator's own knobs: `control`, a `Control` rule in place of the policy's miss rule;
  `detail`, per-layer actions, resident sets and logits too; `stacked`, `stack_layers(cfg,
  params, store.to_device(dtype))`, to share one copy of the layers and the expert table
  between emulations; `profile_counts` for initial="profile"; `low_store`, the
  low-precision copies a policy that fetches them computes dequantised (default: quantised
  now; the table holds 2E experts per layer, e's copy at E + e, `sources.run_experts`);
  `batch`, streams decoded together B at a time sharing every layer's cache
  (`research.shared_batch`), without prefetch, control rules or detail.
  """
  _check(config, control, detail, batch)
  policy, pf, dtype = config.policy, config.prefetch, jnp.dtype(config.dtype)
  budget = resident_lib.make_budget(cfg.num_experts, cfg.top_k, store.expert_nbytes(),
                                    len(cfg.moe_layers), fraction=config.cache_fraction,
                                    nbytes=config.cache_bytes, streaming=pf.streaming)
  if stacked is None:
    stacked = stack_layers(cfg, params, store.to_device(dtype))
  if policy.decision.low:
    stacked = (stacked[0], _with_low_copies(cfg, params, store, stacked[1], policy, dtype,
                                            low_store))
  preds = (speculation.stacked_predictors(cfg, pf.kind, pf.predictors)
           if pf.kind != "none" else None)
  stacked = (stacked[0], _sources(cfg, stacked[1], preds))
  states = layer_stack.stack_states(
      cfg, init_states(cfg, budget, policy, config.initial, profile_counts))
  ctx = decode_lib.Ctx.make(cfg, config, budget, control=control, source="table")
  setup = Setup(ctx=ctx, num_slots=budget.physical, max_len=config.max_len, dtype=dtype.name,
                detail=detail, batch=batch)
  return Emulation(setup, params, *stacked, states, budget)


def _check(config: EngineConfig, control, detail: bool, batch: int):
  """What the emulator runs of an engine's config, with its own knobs."""
  if not isinstance(config, EngineConfig):
    raise EmulatorError(f"emulator.make takes an EngineConfig, got {type(config).__name__} "
                        f"(EngineConfig.make({config!r}, cache_fraction=..., max_len=...) "
                        f"builds one from a policy name)")
  on = config.prefetch.kind != "none"
  if config.prefetch.kind == "oracle" or (on and control is not None):
    raise EmulatorError("the emulator's prefetch takes --prefetch=reuse, quasi, previous or hybrid, "
                        "without a control rule")
  if batch < 1 or (batch > 1 and (on or control is not None or detail)):
    raise EmulatorError(f"--batch={batch}: a batch of streams sharing the cache is >= 1 and runs "
                        "without prefetch, control rules or detail")
  if config.expert_devices != 1:
    raise EmulatorError(f"--expert_devices={config.expert_devices}: the emulator runs one "
                        f"device's cache; emulate with --expert_devices=1")


def _with_low_copies(cfg: ModelConfig, params, store, table, policy: PolicyParams, dtype,
                     low_store):
  """The expert table with every expert's low-precision copy after the E experts."""
  low = low_store or quant.build(store, policy.decision.low_bits)
  if low.bits != policy.decision.low_bits:
    raise EmulatorError(f"--low_bits={policy.decision.low_bits}: the low-precision store "
                        f"holds int{low.bits} copies")
  low_table = stack_layers(cfg, params, low.dequantized(dtype))[1]
  axis = 1 if layer_stack.uniform(cfg) else 0
  cat = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)], axis=axis)
  return jax.tree_util.tree_map(cat, table, low_table)


def run_streams(em: Emulation, tokens_BxT: np.ndarray, pos_T: np.ndarray,
                targets_BxT: np.ndarray, seed: int = 0, chunk: int = 0,
                on_chunk=None) -> dict:
  """Teacher-forced emulation of B streams: the first token is a one-token prompt.

  pos_T: the positions, shared by the streams (pos_T[0] must be 0; a 0 later starts
  a new attention context).  chunk > 0: the scan runs `chunk` tokens per call (the
  carry passed on; T - 1 must be a multiple of it), on_chunk(tokens) after each.

  Returns numpy {"nll": [B,T] (position t: nll of targets[t] after token t),
  "stats": [B,T-1,len(STATS)] (decoded tokens), + detail arrays [B,T-1,...],
  "first_logits" [B,V], "compile_s", "run_s" (seconds of the decode scan without
  its compilation)}.
  """
  tokens_BxT = np.asarray(tokens_BxT, np.int32)
  if tokens_BxT.ndim != 2 or tokens_BxT.shape[1] < 1:
    raise EmulatorError(f"streams must be a non-empty [B, T] token array, got shape "
                        f"{tokens_BxT.shape}")
  pos_T = np.asarray(pos_T, np.int32)
  if pos_T.shape != tokens_BxT.shape[1:] or pos_T[0] != 0:
    raise EmulatorError(f"positions must be [T={tokens_BxT.shape[1]}] starting at 0, got "
                        f"shape {pos_T.shape}")
  if np.any(pos_T >= em.setup.max_len):
    raise EmulatorError(f"a position reaches max_len={em.setup.max_len}; cut documents into "
                        f"windows of at most --max_len tokens")
  b, t = tokens_BxT.shape
  targets_BxT = np.asarray(targets_BxT, np.int32)
  if em.setup.batch > 1:
    return shared_batch.run_streams(em, tokens_BxT, pos_T, targets_BxT, seed, chunk, on_chunk)
  logits, carry = prefill(em.setup, em.params, em.layers, em.table, em.states,
                          tokens_BxT[:, :1], np.ones((b,), np.int32))
  seeds = np.arange(b, dtype=np.int32) + 7919 * seed
  inputs = lambda at, c: (tokens_BxT[:, at:at + c], pos_T[at:at + c],
                          targets_BxT[:, at:at + c], seeds + at)
  return decode_chunks(teacher_forced, em, carry, inputs, logits, targets_BxT, chunk,
                       on_chunk)
