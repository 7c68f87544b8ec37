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

from moejax import routing
from moejax.config import ModelConfig
from moejax import controls, layer_stack
from moejax.controls import Control  # noqa: F401  (public: emulator.Control)
from moejax.layer_stack import stack_layers  # noqa: F401  (public: emulator.stack_layers)
from moejax.model import Transformer, init_cache
from moejax.offload import policy as policy_lib
from moejax.offload import prefetch as pf_files
from moejax.offload import prefetch_steps as pf_steps
from moejax.offload import resident as resident_lib
from moejax.offload.policy import DROP, FETCH, HIT, HOST, SUBSTITUTE, PolicyParams
from moejax.offload.steps import _attend_route, _dense  # shared with the engine's steps

# per-token statistics, summed over MoE layers (the engine's record keys)
STATS = ("expert_calls", "hits", "fetches", "substituted", "substituted_mass", "dropped",
         "dropped_mass", "host_calls", "admissions", "admitted", "evictions", "prefetches",
         "useful_prefetches", "recall_hits", "predicted_calls", "first_substituted")


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
  prefetch: str = "none"         # speculative prefetch predictor (prefetch_steps.PREFETCH)
  speculative: str = "off"       # prefetch_steps.SPECULATIVE
  keep: bool = True              # executed prefetches enter the cache (False: streaming)


# ------------------------------------------------------------------ state
def init_states(cfg: ModelConfig, budget: resident_lib.Budget, policy: PolicyParams,
                initial: str = "auto", profile_counts: dict | None = None) -> dict:
  """Every MoE layer's ResidentState (no slot buffers), filled as the engine fills it."""
  if initial == "auto":
    initial = "all" if budget.all_resident else "empty"
  states = {}
  for l in cfg.moe_layers:
    st = resident_lib.init_state(cfg.num_experts, budget.physical, {}, buffers=False)
    if initial == "all":
      order = range(cfg.num_experts)
    elif initial == "profile":
      if profile_counts is None or l not in profile_counts:
        raise EmulatorError(f"initial='profile' needs profile counts for MoE layer {l}")
      order = resident_lib.profile_order(profile_counts[l])[: budget.slots]
    elif initial == "empty":
      order = []
    else:
      raise EmulatorError(f"--initial must be auto, empty, all or profile, got {initial!r}")
    states[l] = resident_lib.fill(st, order, lambda e: {}, policy.cache, chunk=cfg.top_k)
  return states


def _apply(mod, p, *args, method):
  return mod.apply({"params": p}, *args, method=method)


# ------------------------------------------------------------------ decisions
def _decide(setup: Setup, logits_1xE, state, key):
  if setup.control is not None:
    return controls.decide(setup.control, logits_1xE, state, setup.policy.decision,
                           setup.cfg, key)
  return policy_lib.decide(logits_1xE, state, setup.policy.decision, setup.cfg)


def _moe_layer(setup: Setup, mod, p, table, x, pos, cache, state, pending, key,
               spec=None, prev=None):
  """One MoE layer of one decoded token (engine order); returns x, cache, state, pending,
  stats (with prefetch on: x is (x, r, d, has_prev): what the next MoE layer predicts
  from, and pending is (admit [E], this layer's true logits, True): see
  `layer_stack.empty_carry`)."""
  cfg, pol = setup.cfg, setup.policy.cache
  pending_E, last = (pending[0], pending[1:]) if setup.prefetch != "none" else (pending, None)
  num_e, k = cfg.num_experts, cfg.top_k
  none_in_use = jnp.zeros((num_e,), bool)
  adm_ids = jnp.nonzero(pending_E, size=k, fill_value=-1)[0].astype(jnp.int32)
  state, ev_adm = resident_lib.insert(state, adm_ids, {}, none_in_use, pol)
  h, moe_in, logits, cache = _apply(mod, p, x, pos, cache, pos[0, 0], method=_attend_route)
  pf_used, pf_stats = jnp.full((k,), -1, jnp.int32), jnp.zeros((4,), jnp.float32)
  if setup.prefetch == "none":
    dec = _decide(setup, logits.reshape(1, num_e), state, key)
  else:
    lg = logits.reshape(1, -1)
    hybrid = setup.prefetch == "hybrid"
    dec, pf_used, pf_stats = pf_steps.speculate(
        setup.cfg, mod, p, spec["est"] if hybrid else None, prev, lg,
        state, setup.policy.decision, setup.prefetch, setup.speculative,
        _decide(setup, lg, state, key), last, spec["use_last"] if hybrid else None)
  act = dec.action[0]
  fetch_ids = jnp.where(act == FETCH, dec.ids[0], -1)
  in_use = none_in_use.at[jnp.where(dec.exec_ids[0] >= 0, dec.exec_ids[0], num_e)].set(
      True, mode="drop")
  state, ev_fetch = resident_lib.insert(state, fetch_ids, {}, in_use, pol)
  run_ids = jnp.where(dec.action == HOST, dec.ids, dec.exec_ids)      # host: exact
  w = jnp.where(run_ids >= 0, dec.weights, 0.0)
  x = _apply(mod, p, h, moe_in, jnp.maximum(run_ids, 0).reshape(1, 1, k), w.reshape(1, 1, k),
             table, method="moe_residual")
  state = policy_lib.update_usage(state, dec, pol)
  ev_pf = jnp.full((k,), -1, jnp.int32)
  if setup.prefetch != "none" and setup.keep:   # executed prefetches enter the cache
    state, ev_pf = resident_lib.insert(state, pf_used, {}, in_use, pol)
  ev_trim = jnp.full((state.slot_expert.shape[0],), -1, jnp.int32)
  if setup.trim_to is not None:         # staging slots hold the token in flight only
    state, ev_trim = resident_lib.trim(state, setup.trim_to, pol)
  evicted = jnp.concatenate([ev_adm, ev_fetch, ev_pf, ev_trim])
  share = dec.share[0]
  is_ = lambda a: (act == a).astype(jnp.float32)
  stats = jnp.stack([
      jnp.float32(k), jnp.sum(is_(HIT)), jnp.sum(is_(FETCH)), jnp.sum(is_(SUBSTITUTE)),
      jnp.sum(is_(SUBSTITUTE) * share), jnp.sum(is_(DROP)), jnp.sum(is_(DROP) * share),
      jnp.sum(is_(HOST)), jnp.sum(dec.admit.astype(jnp.float32)),
      jnp.sum(pending_E.astype(jnp.float32)),
      jnp.sum((evicted >= 0).astype(jnp.float32)), *pf_stats,
      is_(SUBSTITUTE)[0] + is_(DROP)[0]])
  detail = dict(action=act, ids=dec.ids[0], sub_ids=dec.sub_ids[0], share=share,
                fetched=fetch_ids, admitted=adm_ids, evicted=evicted,
                admissions=jnp.nonzero(dec.admit, size=k, fill_value=-1)[0].astype(jnp.int32))
  if setup.prefetch != "none":
    d = pf_steps.quasi_offset(dec.exec_ids[0], dec.weights[0], spec["vectors"])
    x = (x, h.reshape(1, -1), d, jnp.bool_(True))
    return x, cache, state, (dec.admit, logits.reshape(1, -1).astype(jnp.float32),
                             jnp.bool_(True)), stats, detail
  return x, cache, state, dec.admit, stats, detail


# ------------------------------------------------------------------ one stream
def _token_step(setup: Setup, params, layers, table, carry, token, pos, key):
  """One decoded token of one stream: returns (carry, logits [V], stats, detail)."""
  cfg = setup.cfg
  dtype = jnp.dtype(setup.dtype)
  model = Transformer(cfg, dtype)
  x = model.apply({"params": params}, token.reshape(1, 1), method="embed")
  pos_11 = pos.reshape(1, 1)
  spec_on = setup.prefetch != "none"
  if spec_on:   # (x, r and d of the previous MoE layer, whether there was one)
    x = (x, jnp.zeros((1, cfg.hidden_size), dtype), jnp.zeros((cfg.hidden_size,), jnp.float32),
         jnp.bool_(False))

  def layer_fn(mod, sparse, p, t, x, pl, i):
    cache, state, pending = pl
    if not sparse:
      if spec_on:
        xd, cache = _apply(mod, p, x[0], pos_11, cache, pos, method=_dense)
        return (xd,) + x[1:], (cache, state, pending), None
      x, cache = _apply(mod, p, x, pos_11, cache, pos, method=_dense)
      return x, (cache, state, pending), None
    t, spec = t if spec_on else (t, None)
    xin, prev = (x[0], x[1:]) if spec_on else (x, None)
    x, cache, state, pending, stats, det = _moe_layer(
        setup, mod, p, t, xin, pos_11, cache, state, pending, jax.random.fold_in(key, i),
        spec, prev)
    if setup.detail:
      det["slot_expert"] = state.slot_expert
    else:
      det = {}
    return x, (cache, state, pending), (stats, det)

  x, per_layer, (stats, det) = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, table, x, layer_stack.zip_carry(cfg, *carry))
  x = x[0] if spec_on else x
  logits = model.apply({"params": params}, x[:, -1], method="logits")[0]
  if setup.detail:
    det["logits"] = logits
  return layer_stack.unzip_carry(cfg, per_layer), logits, jnp.sum(stats, axis=0), det


def _prefill_one(setup: Setup, params, layers, table, states, tokens_P, length, decay_pow):
  """Exact prompt (first `length` of tokens_P) of one stream, as OffloadEngine.prefill."""
  cfg, pol = setup.cfg, setup.policy.cache
  dtype = jnp.dtype(setup.dtype)
  model = Transformer(cfg, dtype)
  num_e, k = cfg.num_experts, cfg.top_k
  plen = tokens_P.shape[0]
  valid = (jnp.arange(plen) < length).astype(jnp.float32)
  pos = jnp.arange(plen, dtype=jnp.int32)[None]
  x = model.apply({"params": params}, tokens_P[None], method="embed")

  def layer_fn(mod, sparse, p, t, x, pl, i):
    cache, st, pending = pl
    t = t[0] if setup.prefetch != "none" else t        # the expert table (not the predictors)
    if not sparse:
      x, cache = _apply(mod, p, x, pos, cache, 0, method=_dense)
      return x, (cache, st, pending), None
    h, moe_in, logits, cache = _apply(mod, p, x, pos, cache, 0, method=_attend_route)
    ids, gates, _ = routing.route(cfg, logits.reshape(plen, num_e))
    x = _apply(mod, p, h, moe_in, ids.reshape(1, plen, k), gates.reshape(1, plen, k), t,
               method="moe_residual")
    counts = jnp.zeros((num_e,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(valid, k))
    used = counts > 0
    resident = st.expert_slot >= 0
    missing = used & ~resident
    # the missing experts, most used first, ties by id, in one insert (the engine's
    # chunks of K, each protecting the ones before, overwrite the same slots)
    order = jnp.lexsort((jnp.arange(num_e), -counts, ~missing))
    ordered = jnp.where(missing[order], order, -1).astype(jnp.int32)
    st, _ = resident_lib.insert(st, ordered, {}, used & resident, pol)
    st = dataclasses.replace(st, last_used=jnp.where(used, st.step, st.last_used),
                             freq=st.freq * decay_pow + counts, step=st.step + 1)
    if setup.trim_to is not None:
      st, _ = resident_lib.trim(st, setup.trim_to, pol)
    return x, (cache, st, pending), jnp.zeros(())

  width = 0 if setup.prefetch == "none" else routing.router_width(cfg)
  cache, pending = layer_stack.empty_carry(cfg, init_cache(cfg, 1, setup.max_len, dtype),
                                           num_e, width)
  x, per_layer, _ = layer_stack.run_layers(
      cfg, dtype, layer_fn, layers, table, x, layer_stack.zip_carry(cfg, cache, states, pending))
  logits = model.apply({"params": params}, jax.lax.dynamic_index_in_dim(x[0], length - 1),
                       method="logits")[0]
  return logits, layer_stack.unzip_carry(cfg, per_layer)


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
  table: object         # the full expert table on the device (see `stack_layers`)
  states: object        # the initial ResidentStates (stacked for uniform models)
  budget: resident_lib.Budget


def make(cfg: ModelConfig, params, store, policy: PolicyParams | str, *,
         cache_fraction: float | None = 0.25, cache_bytes: int | None = None,
         max_len: int = 512, dtype=jnp.float32, initial: str = "auto",
         profile_counts: dict | None = None, control: Control | None = None,
         detail: bool = False, stacked: tuple | None = None, prefetch: str = "none",
         speculative: str = "off", predictors: dict | None = None,
         streaming: bool = False) -> Emulation:
  """An Emulation of `policy` with the engine's budget and initial cache contents.

  `stacked`: `stack_layers(cfg, params, store.to_device(dtype))`, to share one
  copy of the layers and the expert table between emulations.  `prefetch`,
  `speculative`, `predictors` (`prefetch.load_predictors`) and `streaming` as the
  engine's (`prefetch="oracle"` is the engine's check only).
  """
  mode = pf_steps.Mode(prefetch, speculative, keep=not streaming)
  if prefetch == "oracle" or (mode.on and control is not None):
    raise EmulatorError("the emulator's prefetch takes --prefetch=reuse, quasi, previous or hybrid, "
                        "without a control rule")
  if isinstance(policy, str):
    policy = policy_lib.make_policy(policy)
  if max_len < 2:
    raise EmulatorError(f"--max_len must be >= 2, got {max_len}")
  if streaming:
    budget = resident_lib.Budget(cfg.num_experts, cfg.top_k, 0, cfg.top_k, store.expert_nbytes(),
                                 len(cfg.moe_layers), "streaming: no expert kept across tokens")
  else:
    budget = resident_lib.make_budget(cfg.num_experts, cfg.top_k, store.expert_nbytes(),
                                      len(cfg.moe_layers), fraction=cache_fraction,
                                      nbytes=cache_bytes)
  if stacked is None:
    stacked = stack_layers(cfg, params, store.to_device(dtype))
  if mode.on:
    stacked = (stacked[0], (stacked[1], pf_files.stacked_predictors(cfg, prefetch, predictors)))
  states = layer_stack.stack_states(
      cfg, init_states(cfg, budget, policy, initial, profile_counts))
  setup = Setup(cfg, policy, budget.physical, max_len,
                budget.slots if budget.staging else None, jnp.dtype(dtype).name, control,
                detail, prefetch, speculative, not streaming)
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
  logits, carry = prefill(em.setup, em.params, em.layers, em.table, em.states,
                          tokens_BxT[:, :1], np.ones((b,), np.int32))
  first = -np.asarray(jax.nn.log_softmax(logits))[np.arange(b), targets_BxT[:, 0]]
  seeds = np.arange(b, dtype=np.int32) + 7919 * seed
  c = chunk or (t - 1)
  if (t - 1) % max(c, 1):
    raise EmulatorError(f"T - 1 = {t - 1} decoded tokens is not a multiple of chunk={c}")
  outs, compile_s, run_s = [], 0.0, 0.0
  step = None
  for at in range(1, t, max(c, 1)):
    args = (em.params, em.layers, em.table, carry, tokens_BxT[:, at:at + c], pos_T[at:at + c],
            targets_BxT[:, at:at + c], seeds + at)
    if step is None:
      t0 = time.perf_counter()
      step = teacher_forced.lower(em.setup, *args).compile()
      compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry, out = step(*args)
    outs.append(jax.device_get(out))
    run_s += time.perf_counter() - t0
    if on_chunk is not None:
      on_chunk(b * c)
  out = {k: np.concatenate([o[k] for o in outs], axis=1) for k in outs[0]} if outs else {
      "nll": np.zeros((b, 0), np.float32),
      "stats": np.zeros((b, 0, len(STATS)), np.float32)}
  out["nll"] = np.concatenate([first[:, None], out["nll"]], axis=1)
  out["first_logits"] = np.asarray(logits)
  out["compile_s"], out["run_s"] = compile_s, run_s
  return out
