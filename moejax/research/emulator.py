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

import dataclasses
import functools
import time

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
from moejax.offload import layer as layer_lib
from moejax.cache import policy as policy_lib
from moejax.prefetch import steps as pf_steps
from moejax.cache import initial as initial_lib
from moejax.cache import resident as resident_lib
from moejax.offload import decode as decode_lib
from moejax.cache.step import STATS  # noqa: F401  (per-token statistics, summed over MoE layers)
from moejax.cache.policy import PolicyParams


class EmulatorError(ValueError):
  """Bad emulator input; the message names the flag or argument."""


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about an emulation (hashable: a static jit argument)."""
  cfg: ModelConfig
  policy: PolicyParams
  num_slots: int                 # physical slots per MoE layer (budget + staging)
  max_len: int                   # KV cache length (attention window)
  trim_to: int | None            # budget slots S when there are staging slots, else None
  dtype: str = "float32"
  control: Control | None = None
  detail: bool = False           # also return per-layer actions, resident sets, logits
  prefetch: str = "none"         # speculative prefetch predictor (prefetch.PREFETCH)
  speculative: str = "off"       # prefetch.SPECULATIVE
  keep: bool = True              # executed prefetches enter the cache (False: streaming)
  batch: int = 1                 # streams sharing one cache, decoded together (`shared_batch`)


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


def _ctx(setup: Setup) -> layer_lib.Ctx:
  return layer_lib.Ctx(setup.cfg, setup.policy, setup.trim_to, setup.prefetch,
                       setup.speculative, setup.keep, setup.control, "table")


def _token_step(setup: Setup, params, layers, table, carry, token, pos, key):
  """One decoded token of one stream: returns (carry, logits [V], stats, detail)."""
  carry, logits, rec = decode_lib.decode_token(
      _ctx(setup), jnp.dtype(setup.dtype), params, layers, table, carry, token, pos, key,
      scan=True)
  stats = step_lib.record_counts(jnp, rec)
  det = {}
  if setup.detail:
    det = dict(action=rec.actions, ids=rec.ids, sub_ids=rec.substitutes, share=rec.share,
               fetched=rec.fetched, admitted=rec.admitted, evicted=rec.evicted,
               admissions=rec.admissions, logits=logits,
               slot_expert=_slot_experts(setup.cfg, carry[1]))
  return carry, logits, jnp.sum(stats, axis=0), det


def _slot_experts(cfg: ModelConfig, states):
  """Every MoE layer's slot -> expert map, stacked [L, P]."""
  if layer_stack.uniform(cfg):
    return states.slot_expert
  return jnp.stack([states[l].slot_expert for l in cfg.moe_layers])


def _prefill_one(setup: Setup, params, layers, table, states, tokens_P, length, decay_pow):
  """Exact prompt (first `length` of tokens_P) of one stream, as OffloadEngine.prefill."""
  logits, carry, _ = decode_lib.prompt_pass(_ctx(setup), jnp.dtype(setup.dtype), setup.max_len,
                                       params, layers, table, states, tokens_P, length,
                                       decay_pow, scan=True)
  return logits, carry


# ------------------------------------------------------------------ jitted entry points
def prefill(setup: Setup, params, layers, table, states, tokens_BxP, lengths_B):
  """Exact prompts of B streams (each its own copy of `states`): (logits [B,V], carry).

  The prompt of stream b is tokens_BxP[b, :lengths_B[b]] (the rest is padding).
  """
  lengths_B = np.asarray(lengths_B)
  # the LFU decay over a prompt, lfu_decay ** length, rounded from f64 as the engine's
  decay_B = (float(setup.policy.lfu_decay) ** lengths_B.astype(np.float64)).astype(np.float32)
  return _prefill(_prefill_setup(setup), params, layers, table, states, tokens_BxP, lengths_B,
                  decay_B)


@functools.partial(jax.jit, static_argnames=("setup",))
def _prefill(setup: Setup, params, layers, table, states, tokens_BxP, lengths_B, decay_B):
  one = functools.partial(_prefill_one, setup, params, layers, table, states)
  return jax.vmap(one)(tokens_BxP, lengths_B, decay_B)


def _prefill_setup(setup: Setup) -> Setup:
  """The prefill reads only the eviction rule and the LFU decay: one compile serves
  every policy that shares them."""
  return dataclasses.replace(setup, policy=PolicyParams(cache=setup.policy.cache),
                             control=None, detail=False)


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
@dataclasses.dataclass
class Emulation:
  """What an emulation needs besides the tokens: built once per (model, policy, budget)."""
  setup: Setup
  params: dict          # the model's parameters (embedding, head, norms)
  layers: object        # the decoder layers' parameters (see `stack_layers`)
  table: object         # per layer {"table": its experts on the device, + predictors}
  states: object        # the initial ResidentStates (stacked for uniform models)
  budget: resident_lib.Budget


def _sources(cfg: ModelConfig, table, preds):
  """Each layer's expert source for `layer.moe_layer`: the table, and the predictors."""
  if layer_stack.uniform(cfg):
    return dict(table=table, **(preds or {}))
  return [None if t is None else dict(table=t, **(preds[i] if preds else {}))
          for i, t in enumerate(table)]


def make(cfg: ModelConfig, params, store, policy: PolicyParams | str, *,
         cache_fraction: float | None = 0.25, cache_bytes: int | None = None,
         max_len: int = 512, dtype=jnp.float32, initial: str = "auto",
         profile_counts: dict | None = None, control: Control | None = None,
         detail: bool = False, stacked: tuple | None = None, prefetch: str = "none",
         speculative: str = "off", predictors: dict | None = None,
         streaming: bool = False, low_store=None, batch: int = 1) -> Emulation:
  """An Emulation of `policy` with the engine's budget and initial cache contents.

  `stacked`: `stack_layers(cfg, params, store.to_device(dtype))`, to share one
  copy of the layers and the expert table between emulations.  `prefetch`,
  `speculative`, `predictors` (`prefetch.load_predictors`) and `streaming` as the
  engine's (`prefetch="oracle"` is the engine's check only).  A policy that fetches
  low-precision copies computes them dequantised (`low_store`, default: quantised now):
  the table holds 2E experts per layer, e's copy at E + e (`sources.run_experts`).
  batch: streams decoded together B at a time, sharing every layer's cache
  (`research.shared_batch`), without prefetch, control rules or detail.
  """
  mode = pf_steps.Mode(prefetch, speculative, keep=not streaming)
  if prefetch == "oracle" or (mode.on and control is not None):
    raise EmulatorError("the emulator's prefetch takes --prefetch=reuse, quasi, previous or hybrid, "
                        "without a control rule")
  if isinstance(policy, str):
    policy = policy_lib.make_policy(policy)
  if batch < 1 or (batch > 1 and (mode.on or control is not None or detail)):
    raise EmulatorError(f"--batch={batch}: a batch of streams sharing the cache is >= 1 and runs "
                        "without prefetch, control rules or detail")
  if max_len < 2:
    raise EmulatorError(f"--max_len must be >= 2, got {max_len}")
  budget = resident_lib.make_budget(cfg.num_experts, cfg.top_k, store.expert_nbytes(),
                                    len(cfg.moe_layers), fraction=cache_fraction,
                                    nbytes=cache_bytes, streaming=streaming)
  if stacked is None:
    stacked = stack_layers(cfg, params, store.to_device(dtype))
  preds = speculation.stacked_predictors(cfg, prefetch, predictors) if mode.on else None
  if policy.decision.low:
    low = low_store or quant.build(store, policy.decision.low_bits)
    if low.bits != policy.decision.low_bits:
      raise EmulatorError(f"--low_bits={policy.decision.low_bits}: the low-precision store "
                          f"holds int{low.bits} copies")
    low_table = stack_layers(cfg, params, low.dequantized(dtype))[1]
    axis = 1 if layer_stack.uniform(cfg) else 0
    cat = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)], axis=axis)
    stacked = (stacked[0], jax.tree_util.tree_map(cat, stacked[1], low_table))
  stacked = (stacked[0], _sources(cfg, stacked[1], preds))
  states = layer_stack.stack_states(
      cfg, init_states(cfg, budget, policy, initial, profile_counts))
  setup = Setup(cfg, policy, budget.physical, max_len,
                budget.slots if budget.staging else None, jnp.dtype(dtype).name, control,
                detail, prefetch, speculative, not streaming, batch)
  return Emulation(setup, params, *stacked, states, budget)


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
    from moejax.research import shared_batch   # it builds on this module
    return shared_batch.run_streams(em, tokens_BxT, pos_T, targets_BxT, seed, chunk, on_chunk)
  logits, carry = prefill(em.setup, em.params, em.layers, em.table, em.states,
                          tokens_BxT[:, :1], np.ones((b,), np.int32))
  seeds = np.arange(b, dtype=np.int32) + 7919 * seed
  inputs = lambda at, c: (tokens_BxT[:, at:at + c], pos_T[at:at + c],
                          targets_BxT[:, at:at + c], seeds + at)
  return decode_chunks(teacher_forced, em, carry, inputs, logits, targets_BxT, chunk,
                       on_chunk)


def decode_chunks(program, em: Emulation, carry, inputs, logits_NxV, targets_NxT, chunk: int,
                  on_chunk, unpack=lambda out: out) -> dict:
  """The decoded tokens 1..T-1 of N streams after their prompts (logits_NxV), by the jitted
  `program(setup, params, layers, table, carry, *inputs(at, c))` over `chunk` tokens a call
  (compiled once; `unpack` makes a call's output per stream) -> `run_streams`'s dict."""
  n, t = targets_NxT.shape
  first = -np.asarray(jax.nn.log_softmax(logits_NxV))[np.arange(n), targets_NxT[:, 0]]
  c = chunk or (t - 1)
  if (t - 1) % max(c, 1):
    raise EmulatorError(f"T - 1 = {t - 1} decoded tokens is not a multiple of chunk={c}")
  outs, compile_s, run_s, step = [], 0.0, 0.0, None
  for at in range(1, t, max(c, 1)):
    args = (em.params, em.layers, em.table, carry) + inputs(at, c)
    if step is None:
      t0 = time.perf_counter()
      step = program.lower(em.setup, *args).compile()
      compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry, out = step(*args)
    outs.append(unpack(jax.device_get(out)))
    run_s += time.perf_counter() - t0
    if on_chunk is not None:
      on_chunk(n * c)
  out = {k: np.concatenate([o[k] for o in outs], axis=1) for k in outs[0]} if outs else {
      "nll": np.zeros((n, 0), np.float32),
      "stats": np.zeros((n, 0, len(STATS)), np.float32)}
  out["nll"] = np.concatenate([first[:, None], out["nll"]], axis=1)
  out["first_logits"] = np.asarray(logits_NxV)
  out["compile_s"], out["run_s"] = compile_s, run_s
  return out
