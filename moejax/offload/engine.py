"""OffloadEngine: real decoding with a budgeted device-resident expert cache.

  eng = OffloadEngine(cfg, params, store, EngineConfig.make("quality", cache_fraction=.25))
  with eng:                      close() on exit (a context manager)
    eng.warmup()                 compiles the decode step (throwaway state)
    logits = eng.prefill(prompt_ids)       # [V]; exact for every policy
    logits = eng.decode_step(token)        # [V]; one stats.TokenRecord appended
    logits = eng.decode_step(tok, lazy=True)   # a device array; the record is read later
    ids = eng.generate(prompt_ids, SamplingParams(...))   # on-device loop, or per token
    eng.stats(skip=16); eng.resident_sets()    # summary of the records; resident ids
    rows = eng.batched(8)                  # several sequences at once (`batch.Batched`)

A decode step is ONE jitted program (`decode.step_fn`): every layer, and in each MoE
layer the one per-layer sequence (`decode.moe_layer`) with its copies from the host
store made inside the program.  The host dispatches it and reads the token's small
decisions (`cache.step.Record`); with `lazy=True` (or in `generate`'s while_loop, native
link only) that read happens later, behind the device.  An emulated link
(`link.LinkClock`) makes the host wait out, after each token, its copies' time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import heap, placement
from moejax.kernels import cpu_kernel
from moejax.model import layer_stack
from moejax.model.config import ModelConfig
from moejax.offload import assembly, decode, expert_parallel, prompt
from moejax.offload import batch as batch_lib, link as link_lib
from moejax.cache import policy as policy_lib
from moejax.prefetch import steps as pf_steps
from moejax.cache import initial as initial_lib
from moejax.offload.config import EngineConfig, check_policy
from moejax.offload.stats import (Kept, TokenRecord, build_record, link_counts,
                                  prefill_record, summary)
from moejax.model.sampler import SamplingParams, bucket, token_loop


class _Lazy(NamedTuple):
  """A lazy step not read back yet: its packed Record on the device, its start."""
  packed: Any
  t0: float


def _cached_program(table: dict, key, limit: int, build):
  """table[key], built by `build()` the first time (compiled programs: the newest `limit`)."""
  if key not in table:
    while len(table) >= limit:
      table.pop(next(iter(table)))
    table[key] = build()
  return table[key]


class OffloadEngine:
  """Decoding under an expert budget with a policy; in-program copies from the host store."""

  def __init__(self, cfg: ModelConfig, params, store, config: EngineConfig = EngineConfig(),
               *, low_store=None, counts: dict | None = None, model=None):
    """config: `EngineConfig` (`EngineConfig.make("quality", cache_fraction=0.25)`).
    low_store: the low-precision copies a policy that fetches them reads
    (`io.quant.load_or_build`; default: quantised now, in memory).  counts: {MoE layer:
    routing counts} for initial="profile" (`calibrate.profile_counts`).  model: the
    `moejax.Model` decoded (`from_model`: its tokenizer is `moejax.generate`'s), or None."""
    assembly.check_args(config, counts)
    self.config, self.model = config, model
    self.device = jax.local_devices()[0]
    self.cfg, self.store, self.policy, self.link = cfg, store, config.policy, config.link
    self.dtype, self.max_len = config.dtype, config.max_len
    self.transfer_timeout_s = float(config.transfer_timeout_s)
    self.moe_layers = tuple(cfg.moe_layers)
    self.prefetch = pf = config.prefetch
    self.mode = pf_steps.Mode(pf.kind, pf.speculative, keep=not pf.streaming)
    self.budget, self.plan = assembly.budget_and_plan(cfg, store, config)
    self.low_store, self.staging = assembly.side_stores(store, config, self.device.platform,
                                                        low_store)
    self.low_nbytes = self.low_store.expert_nbytes() if self.low_store else 0
    scan, pinned = self._place(params)
    self.initial = initial_lib.resolve_initial(config.initial, self.budget)
    self._states = assembly.initial_states(store, cfg, self.budget, self.initial, self.policy,
                                           self.mode, self.device, scan, counts, self.plan)
    self._state_shapes = jax.eval_shape(lambda: self._states)   # (the records' layout)
    ctx = assembly.layer_ctx(self, pinned)
    self._use_program(decode.Program(ctx, jnp.dtype(self.dtype).name, self.max_len, scan))
    self._clock = link_lib.LinkClock(self.link, store.expert_nbytes(), self.moe_layers,
                                     config.expert_devices)
    self._carry = None            # a `layer_stack.Carry` once a prompt ran
    self.end_index = 0
    self._kept = Kept()           # the steps' records: a tally, the newest kept whole
    heap.hold_mmap_threshold()    # each generation's new big arrays mapped, not heaped
    self._deferred: list[_Lazy] = []     # lazy steps not read back yet
    self._loops: dict = {}        # (steps, temperature, top_p, stop shape) -> compiled loop
    self._prompts: dict = {}      # (program, bucket) -> compiled prompt pass
    self.prefill_record: TokenRecord | None = None
    self._failed: BaseException | None = None
    self._batch = None            # the `batch.Batched` the states were handed to
    self._compiled = None         # the program whose decode step `start_call` compiled

  @classmethod
  def from_model(cls, model, policy: policy_lib.PolicyParams | str = "baseline", *,
                 low_store=None, counts: dict | None = None, **kw) -> "OffloadEngine":
    """An engine of a loaded `moejax.Model` with moejax-generate's defaults
    (`EngineConfig.for_model`: policy, cache_fraction, link, prefetch, speculative,
    estimators, max_len and the other fields); low_store and counts as the constructor's."""
    return cls(model.cfg, model.params, model.store, EngineConfig.for_model(model, policy, **kw),
               low_store=low_store, counts=counts, model=model)

  # -------------------------------------------------------------- construction
  def _place(self, params) -> tuple[bool, bool]:
    """The parameters and the expert sources on the device(s) -> (the layers as one scan,
    the store pinned).  A scan (`decode.Program.scan`): a uniform model on one device whose
    store (and low-precision store) is one [L, E, ...] array per kind; else unrolled (the
    host staging tier too: it reads per layer)."""
    cfg, put = self.cfg, self._put
    host, pinned, scan = placement.program_stores(
        self.store, self.low_store, self.device,
        self.config.layer_scan and self.plan is None and layer_stack.uniform(cfg), self.staging)
    if self.plan is not None:   # the store on every device too
      host = put(host)
    self.params = put(decode.stack_params(cfg, params) if scan else params)
    self._srcs = assembly.expert_sources(cfg, host, self.prefetch, self.mode, scan, put)
    return scan, pinned

  program = property(lambda self: self._prog, doc="The programs' static part (`decode.Program`).")
  sources = property(lambda self: self._srcs, doc="The MoE layers' expert sources, as passed.")

  def batched(self, max_batch: int) -> batch_lib.Batched:
    """`batch.Batched`: up to `max_batch` sequences at once on this engine's experts."""
    self._check(), self._read_deferred(), self._kept.build(self._record)
    self._batch = batch_lib.Batched(self, self._live_states(), max_batch)
    self._carry = self._states = None
    return self._batch

  def describe(self) -> str:
    pf = (f"; prefetch {self.mode.prefetch}, speculative {self.mode.speculative}"
          if self.mode.on else "")
    return (f"policy {self.policy.describe()}; {self.budget.describe()}; "
            f"link {self.link.describe()}{pf}")

  # -------------------------------------------------------------- lifetime
  def close(self):
    """Releases the device state (nothing runs in the background)."""
    self._carry, self._srcs, self._loops, self._prompts = None, None, {}, {}

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    self.close()

  @property
  def states(self) -> dict:
    """The per-MoE-layer ResidentStates (read-only; of a scanned program, sliced out of
    the stacked ones)."""
    return decode.per_layer(self._prog, self.moe_layers, self._live_states())

  def _live_states(self):
    """The states as the programs take them ({layer: state}, or stacked [L, ...])."""
    if self._srcs is None:
      raise placement.TransferError("the engine is closed")
    if self._batch is not None:
      raise RuntimeError("this engine's resident experts decode in a batch (`batched`)")
    return self._carry.states if self._carry is not None else self._states

  def resident_sets(self) -> dict[int, list[int]]:
    """{MoE layer: resident experts} after the last step, the admissions it requested
    included (they are inserted at the end of the token that requests them)."""
    return {l: s.resident_experts() for l, s in self.states.items()}

  @property
  def records(self) -> list[TokenRecord]:
    """The newest decode steps' records, in order (lazy steps' are read first): at most
    `stats.RECORDS_KEPT`, so that a long run's memory does not grow with its tokens."""
    self._read_deferred()
    return list(self._kept.build(self._record).whole)

  def stats(self, skip: int = 0) -> dict:
    """Summary of every decode step since the records were last taken, after the first
    `skip` (warm-up; at most `stats.HEAD_TOKENS`)."""
    self._read_deferred()
    out = summary(self._kept.build(self._record).tally, self.cfg, skip)
    return dict(out, **self.staging.counts()) if self.staging else out

  def _check(self):
    if self._failed is not None:
      raise placement.TransferError(f"the engine stopped after an earlier failure: "
                                   f"{self._failed}") from self._failed
    if self._srcs is None:
      raise placement.TransferError("the engine is closed")

  # -------------------------------------------------------------- programs
  def warmup(self, prompt_lengths=()):
    """Compiles the decode step, and the prompt pass of each of `prompt_lengths`' buckets,
    so that records time decoding, not compiling; nothing runs (no throwaway copy of the
    slot buffers: Qwen3-30B-A3B's are 1.2 GB a layer at 25%) and the resident sets stay."""
    self._check()
    self._step.lower(self.params, self._srcs, self.new_carry(), np.int32(0),
                     np.int32(0)).compile()
    for p in prompt.buckets(self._prog, prompt_lengths):
      self._prompt_program(p)

  def set_policy(self, policy: policy_lib.PolicyParams | str):
    """Decodes from now on under `policy`, keeping the resident sets, the budget and the
    link (a server's per-request policy).  Each policy is its own program: the first
    use of one compiles its steps; going back to one reuses them."""
    self._check()
    if isinstance(policy, str):
      policy = policy_lib.make_policy(policy)
    if policy == self.policy:
      return
    if policy.decision.low and self.low_store is None:
      raise policy_lib.PolicyError(f"{policy.describe()} fetches low-precision copies, which "
                                   "this engine was not built with: build it with that policy")
    check_policy(policy, self.device.platform, self.low_store if policy.decision.low else None,
                 staged=self.staging is not None)
    self._read_deferred()
    self._kept.build(self._record)     # read under the program that made them
    self.policy = policy
    self._use_program(dataclasses.replace(self._prog, ctx=dataclasses.replace(
        self._prog.ctx, policy=policy)))
    self._loops = {}

  def _use_program(self, prog: decode.Program):
    """Decodes with `prog` from now on: its jitted step and its records' layout
    (`decode.record_layout`, known before any step runs)."""
    self._prog, self._step = prog, decode.step_fn(prog)
    self.record_layout = decode.record_layout(prog, self._state_shapes)

  def _prompt_program(self, bucket: int):
    """The current program's prompt pass for `bucket` tokens, compiled once (8 kept)."""
    return _cached_program(self._prompts, (self._prog, bucket), 8, lambda: prompt.compile_prompt(
        self._prog, self.params, self._srcs, self._live_states(), bucket))

  def start_call(self):
    """Before one `moejax.generate` call, as moejax-generate before its one generation: the
    decode step of the current program (policy) compiled, once a program, so that no
    record times a compile; and the earlier calls' records handed over, so that `stats()`
    afterwards describes this call alone."""
    if self._compiled is not self.program:
      self.warmup()
      self._compiled = self.program
    self.take_records()

  def take_records(self) -> list[TokenRecord]:
    """The records `records` holds, handed over, and `stats` started afresh."""
    self._read_deferred()
    return self._kept.take(self._record)

  def _put(self, tree):
    """Dense pytrees (parameters, the KV cache) on the device, or on every device of the
    plan (expert-parallel)."""
    if self.plan is None:
      return jax.device_put(tree, self.device)
    return expert_parallel.replicate(self.plan, tree)

  def new_carry(self, states=None, rows: int = 1):
    """The `layer_stack.Carry` of an empty KV cache of `rows`, states (default: the live
    ones) and nothing pending."""
    states = self._live_states() if states is None else states
    empty = decode.empty_carry(self._prog.ctx, self.dtype, self.max_len, {},
                               scan=self._prog.scan, rows=rows)
    return layer_stack.Carry(self._put(empty.cache), states, self._put(empty.carried))

  def prefill(self, prompt_ids) -> np.ndarray:
    """Runs the prompt (exact for every policy); returns the last position's logits [V]."""
    self._check()
    self._read_deferred()
    t = len(prompt_ids)
    if t < 1:
      raise ValueError("prefill needs at least one prompt token")
    if t + 1 > self.max_len:
      raise ValueError(f"prompt of {t} tokens does not fit max_len={self.max_len}")
    toks = np.zeros((prompt.prompt_bucket(self._prog, t),), np.int32)
    toks[:t] = prompt_ids
    run = self._prompt_program(len(toks))
    t0 = time.perf_counter()      # (the record times the prompt, not its compile)
    states = self._live_states()
    self._carry = None
    decay = np.float32(float(self.policy.lfu_decay) ** np.float64(t))
    logits, carry, did = run(self.params, self._srcs, states, toks, np.int32(t), decay)
    self._carry, self._states = carry, None
    out, copied, evicted = jax.device_get((logits, did.copied_E, did.evicted_EP))
    self._clock.reset()
    self.end_index = t
    waits = {}
    if self.link.emulated:   # each layer waits for the missing experts its prompt used
      n_l = np.sum(np.asarray(copied) >= 0, axis=-1)
      none = np.zeros_like(n_l)
      waits = self.charge_link(t0, f"the {t}-token prompt", n_l, none, none)
      self._clock.reset()
    self.prefill_record = prefill_record(t, self.moe_layers, copied, evicted,
                                         self.store.expert_nbytes(), time.perf_counter() - t0)
    self.prefill_record.wait_s = waits.get("wait_s", 0.0)
    return np.asarray(out)

  def charge_link(self, t0: float, what: str, fetches, admissions, prefetches) -> dict:
    """Sleeps out the emulated link's time for copies counted per MoE layer (`LinkClock`)
    since t0 -> its waits; past `transfer_timeout_s` the engine stops with TransferTimeout."""
    try:
      return self._clock.charge(t0, what, self.transfer_timeout_s, fetches, admissions,
                                prefetches)
    except placement.TransferTimeout as e:
      self._failed = e
      raise

  def decode_step(self, token, lazy: bool = False):
    """Feeds one token at position `end_index`; returns the next-token logits [V].

    lazy=True: the logits as a device array, and `token` may be a device int32
    scalar; with a native link the step does not wait for the device, and its record
    is built when `records`/`stats` is next read (its wall time is then the interval
    between consecutive dispatches).  Decisions and logits are those of a plain step.
    A loop of steps runs faster inside `cpu_kernel.decoding()` (`generate` enters it).
    """
    self._check()
    if self._carry is None:
      raise ValueError("decode_step before prefill")
    if self.end_index >= self.max_len:
      raise ValueError(f"max_len={self.max_len} reached")
    t0 = time.perf_counter()
    self._carry, logits, rec = self._step(self.params, self._srcs, self._carry,
                                             token if lazy else np.int32(token),
                                             np.int32(self.end_index))
    self.end_index += 1
    if lazy and not self.link.emulated:
      self._deferred.append(_Lazy(rec, t0))
      if len(self._deferred) > 64:
        self._read_deferred(keep=32)
      return logits
    self._read_deferred()
    out, rec = jax.device_get((logits, rec))
    rec = np.array(rec)           # its own memory, not a view holding the device buffer
    waits = {}
    if self.link.emulated:
      counts = link_counts(self.record_layout.unpack(rec),
                           self.low_nbytes / self.store.expert_nbytes(), self.plan)
      waits = self.charge_link(t0, f"the token at position {self.end_index - 1}", *counts)
    self._kept.add((rec, time.perf_counter() - t0, waits), self._record)
    return jnp.asarray(out) if lazy else out

  def _read_deferred(self, keep: int = 0):
    """Reads back the decisions of lazy steps, all but the newest `keep`."""
    while len(self._deferred) > keep:
      done = self._deferred.pop(0)
      nxt = self._deferred[0].t0 if self._deferred else time.perf_counter()
      self._kept.add((np.array(done.packed), nxt - done.t0, {}), self._record)

  def _record(self, packed, wall_s: float, waits: dict, layers: bool) -> TokenRecord:
    """A step's record of its packed decisions (built when read, or once
    `stats.RECORDS_KEPT` wait: a decode step itself keeps only its numpy arrays)."""
    rec = build_record(self.record_layout.unpack(packed), self.moe_layers,
                       self.store.expert_nbytes(), self.low_nbytes, self.plan, layers=layers)
    rec.finish(wall_s, **waits)
    return rec

  def generate(self, prompt_ids, sp: SamplingParams, seed: int = 0, on_token=None) -> list[int]:
    """Prefill + up to sp.max_new_tokens sampled tokens (batch 1).  Without `on_token`
    and with a native link every token is decoded in one on-device loop
    (`decode.loop`); else token by token (an emulated link waits per token)."""
    t = len(prompt_ids)
    if t + sp.max_new_tokens > self.max_len:
      raise ValueError(f"prompt ({t}) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                       f"max_len={self.max_len}")
    key = jax.random.PRNGKey(seed)
    logits = self.prefill(prompt_ids)
    if sp.max_new_tokens == 0:
      return []
    if on_token is None and not self.link.emulated:
      with cpu_kernel.decoding():     # the CPU kernel's helpers spin between calls
        return self._generate_loop(logits, sp, key)
    return token_loop(logits, lambda tid, i: self.decode_step(tid), sp, key, on_token)

  def _generate_loop(self, logits, sp: SamplingParams, key) -> list[int]:
    self._check()
    stop = np.full(bucket(len(sp.stop_ids), 4), -1, np.int32)
    stop[:len(sp.stop_ids)] = sp.stop_ids
    bucket_new = bucket(max(sp.max_new_tokens, 1))
    args = (self.params, self._srcs, self._carry, jnp.asarray(logits),
            np.int32(self.end_index), key, np.int32(sp.max_new_tokens), stop,
            np.float32(sp.temperature), np.float32(sp.top_p), sp.forced(bucket_new))
    statics = dict(bucket_new=bucket_new, greedy=sp.temperature == 0.0, nucleus=sp.top_p < 1.0)
    key_s = tuple(statics.values()) + (stop.shape,)
    loop = _cached_program(self._loops, key_s, 4,   # compiled ahead: records time decoding
                           lambda: decode.loop.lower(self._prog, *args, **statics).compile())
    t0 = time.perf_counter()
    self._carry, toks, n, recs = loop(*args)
    toks, n, recs = jax.device_get((toks, n, recs))
    n = int(n)
    wall = (time.perf_counter() - t0) / max(1, n - 1)
    for i in range(n - 1):
      self._kept.add((recs[i], wall, {}), self._record)
    self.end_index += n - 1
    return [int(x) for x in toks[:n]]

