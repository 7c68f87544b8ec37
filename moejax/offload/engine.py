"""OffloadEngine: real decoding with a budgeted device-resident expert cache.

Public surface (benchmarks and tests use only this):

  eng = OffloadEngine(cfg, params, store, policy, cache_fraction=.25, link=...)
  with eng: ...                 close() on exit (a context manager); an engine never
                                closed is shut down when garbage collected
  eng.warmup()                  compiles every decode-path step on throwaway state
  eng.prefill(prompt_ids)       -> next-token logits [V]; exact for every policy
  eng.decode_step(token)        -> next-token logits [V]; appends a stats.TokenRecord
  eng.decode_step(tok, lazy=True)   the same, logits left on the device; with every
                                expert resident the token may be a device scalar and
                                the step does not wait for the device (records are
                                read when `records` or `stats` is next read)
  eng.generate(prompt, sp)      prefill + sampling, batch 1
  eng.stats(skip=0)             summary of the decode records (`stats.summarize`)
  eng.deferred_steps            lazy steps whose records are not built yet
  eng.records, eng.prefill_record   per-token `stats.TokenRecord`s (counts, times,
                                per-layer actions, substitutes, admissions, evictions)
  eng.resident_sets()           {layer: resident experts}, every requested admission
                                inserted first (a defined end state)
  eng.held_bytes()              bytes of expert copies held outside the slot buffers
  eng.transfer_stats()          transfer counters (requests, bytes, link busy time)
  eng.describe(), eng.budget, eng.link, eng.policy, eng.states (read-only pytrees)
  eng.cfg, eng.store, eng.moe_layers, eng.max_len, eng.end_index   (read-only)
  eng.trace = True              each decode step appends its timeline to eng.traces
  eng.close()

Per MoE layer and decoded token (jitted steps: `steps`; inserts: `inserts`):
  1. insert the admissions requested at the previous token, fused with attention,
     router and `policy.decide`; the host reads the packed decision;
  2. copy the FETCH experts at once (`Prefetcher.fetch`) and insert them while
     their link time elapses, with other layers' arrived admissions; queue new
     admissions; compute HOST experts in numpy;
  3. the experts from slot indices, usage update, trim back to the budget S: run in
     the same dispatch as the next MoE layer's step 1 when the two layers are
     consecutive (`steps.fused_steps`; `fuse_layers=False` keeps separate calls).
By default (`run_layers=True`) the layers that need none of the host's work run
together in one call that stops at the first that does (`runs`): a token whose
layers all hit is one call, and the host works only where steps 1-2 have work.
With every expert resident (cache_fraction 1.0) no layer can need the host, and
that call is compiled without the per-layer conds (`runs`, straight;
`straight_run=False` keeps the conds, for before/after measurements).
The layer itself is `layer_decode.LayerDecoder`.  Waits time out after
`transfer_timeout_s` (TransferError naming layer and expert).
Batch size 1.  Every printed time names the link (`Link.describe()`).
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax import families
from moejax.config import ModelConfig
from moejax.model import init_cache
from moejax.offload import copies
from moejax.offload import host_experts
from moejax.offload import inserts
from moejax.offload import layer_decode
from moejax.offload import link as link_lib
from moejax.offload import policy as policy_lib
from moejax.offload import prefetch as prefetch_lib
from moejax.offload import prefetch_steps as pf_steps
from moejax.offload import prompt
from moejax.offload import resident as resident_lib
from moejax.offload import runs as runs_lib
from moejax.offload import steps as steps_lib
from moejax.offload import token_decode
from moejax.offload import transfer as transfer_lib
from moejax.offload.stats import TokenRecord, format_stats, summarize  # noqa: F401 (re-export)
from moejax.sampler import SamplingParams, bucket, next_token


def _shutdown(prefetcher: transfer_lib.Prefetcher):
  """The finaliser of an engine never closed: stops its prefetch thread."""
  try:
    prefetcher.close(timeout=5.0)
  except Exception:  # pylint: disable=broad-except  (nothing to raise to in a finaliser)
    pass


class OffloadEngine:
  """Decoding under an expert budget with a policy, real transfers on a prefetch thread."""

  def __init__(self, cfg: ModelConfig, params, store,
               policy: policy_lib.PolicyParams | str = "baseline", *,
               cache_fraction: float | None = 0.25, cache_bytes: int | None = None,
               link: Any = "native", max_len: int = 512, dtype=jnp.float32,
               initial: Any = "auto", profile_counts: dict | None = None,
               transfer_timeout_s: float = 120.0, verbose: bool = False,
               prefetch: str = "none", speculative: str = "off",
               predictors: dict | None = None, streaming: bool = False,
               fuse_layers: bool = True, run_layers: bool = True, run_min_layers: int = 3,
               straight_run: bool = True):
    if isinstance(policy, str):
      policy = policy_lib.make_policy(policy)
    if isinstance(link, str) and link.strip().lower().startswith("scaled"):
      raise link_lib.LinkSpecError(
          f"link={link!r}: a scaled link needs this machine's layer compute time; build it "
          f"with moejax.offload.calibrate.calibrated_link(spec, cfg, params, store, dtype) "
          f"and pass the Link")
    # every array the steps see is committed to one device: one compile per step
    self.device = jax.devices()[0]
    self._put = functools.partial(jax.device_put, device=self.device)
    self.cfg, self.params, self.store, self.policy = cfg, self._put(params), store, policy
    self.dtype, self.max_len = dtype, max_len
    self.transfer_timeout_s = float(transfer_timeout_s)
    self.moe_layers = tuple(cfg.moe_layers)
    if streaming:      # no cache: K staging slots, emptied after every token
      self.budget = resident_lib.Budget(cfg.num_experts, cfg.top_k, 0, cfg.top_k,
                                        store.expert_nbytes(), len(self.moe_layers),
                                        "streaming: no expert kept across tokens")
    else:
      self.budget = resident_lib.make_budget(
          cfg.num_experts, cfg.top_k, store.expert_nbytes(), len(self.moe_layers),
          fraction=cache_fraction, nbytes=cache_bytes)
    self.mode = pf_steps.Mode(prefetch, speculative, keep=not streaming)
    if policy.miss == "host":
      host_experts.check_supported(store.get(self.moe_layers[0], 0), cfg.model_type)
    self.link = link if isinstance(link, link_lib.Link) else link_lib.parse_link(
        link, expert_bytes=store.expert_nbytes())
    self._trim_to = self.budget.slots if self.budget.staging else None
    self._model = steps_lib.model_steps(cfg, dtype)
    self._steps = [steps_lib.layer_steps(cfg, dtype, i, policy.decision, policy.cache,
                                         self._trim_to) for i in range(cfg.num_layers)]
    # MoE layer i's moe call fused with layer i+1's decision (None: separate calls; the
    # prefetch path has its own steps)
    run = run_layers and not self.mode.on
    self._run = (runs_lib.run_fn(cfg, dtype, policy.decision, policy.cache, self._trim_to)
                 if run else None)
    self._no_pend = None          # a run's placeholder pending layer (built by warmup)
    fuse = fuse_layers and not self.mode.on
    self._fused = {i: steps_lib.fused_steps(cfg, dtype, i, policy.decision, policy.cache,
                                            self._trim_to) if fuse else None
                   for i in self.moe_layers}
    first = store.get(self.moe_layers[0], 0)
    self._zero_rows = self._put({k: np.zeros((cfg.top_k,) + np.shape(v), np.asarray(v).dtype)
                                 for k, v in first.items()})
    spec = {k: (np.shape(v), jnp.dtype(np.asarray(v).dtype)) for k, v in first.items()}
    self.states = {l: self._put(resident_lib.init_state(cfg.num_experts, self.budget.physical,
                                                        spec)) for l in self.moe_layers}
    self._zero_x = np.zeros((1, 1, cfg.hidden_size), jnp.dtype(dtype))   # host expert output
    states, initial = resident_lib.fill_initial(
        self.states, initial, self.budget, store, policy.cache, cfg, profile_counts)
    self.states = runs_lib.StateTable(states)
    # every expert resident for good: a token's layer run cannot stop (`runs`, straight)
    straight = straight_run and run and self.budget.all_resident and initial == "all"
    self._straight = (runs_lib.run_fn(cfg, dtype, policy.decision, policy.cache, self._trim_to,
                                      straight=True) if straight else None)
    # the CPU backend's device memory is host memory: transfers copy into private host
    # stacks that the jitted inserts take as arguments
    self._host_rows = (self.device.platform == "cpu"
                       and all(isinstance(v, np.ndarray) for v in first.values()))
    # the decode thread spins through its waits for link time: after a sleep its next
    # device call runs slower (the idle CPU's wake-up)
    self.prefetcher = transfer_lib.Prefetcher(store, self.link, host_copies=self._host_rows,
                                              wait_spin_s=float("inf"))
    self._finalizer = weakref.finalize(self, _shutdown, self.prefetcher)
    self._slots = inserts.SlotWriter(self.states, self._steps, self.moe_layers, cfg.top_k,
                                     cfg.num_experts, self._zero_rows, self.transfer_timeout_s)
    self._spec, self._pf_steps = None, None
    if self.mode.on:
      self._spec = prefetch_lib.Speculator(
          cfg, dtype, self.mode, predictors, self.prefetcher, self.states, self._put,
          self._host_rows, self._zero_rows, self.transfer_timeout_s, store.expert_nbytes(),
          self._slots.admitting)
      self._pf_steps = {l: pf_steps.layer_steps(cfg, dtype, steps_lib.representative(cfg, l),
                                                policy.decision, policy.cache, self.mode,
                                                self._trim_to, l == self.moe_layers[0])
                        for l in self.moe_layers}
    self._layers = layer_decode.LayerDecoder(
        cfg, self.states, self._slots, self.prefetcher, store, self._fused,
        self._trim_to, self._zero_x, self._spec, self._pf_steps, self._run, self._steps,
        policy, fuse_layers, self._straight)
    self._tokens = token_decode.TokenDecoder(cfg, self._layers, self._steps, self._model,
                                             self._fused, run_min_layers)
    self.cache = None
    self.end_index = 0
    self._records: list[TokenRecord] = []
    self.prefill_record: TokenRecord | None = None
    self.trace = False
    self.traces: list[list[tuple[str, int, float]]] = []
    if verbose:
      print(f"[moejax] {self.describe()}", file=sys.stderr)

  def describe(self) -> str:
    pf = (f"; prefetch {self.mode.prefetch}, speculative {self.mode.speculative}"
          if self.mode.on else "")
    return (f"policy {self.policy.describe()}; {self.budget.describe()}; "
            f"link {self.link.describe()}{pf}")

  # -------------------------------------------------------------- lifetime
  def close(self, timeout: float | None = None):
    """Cancels pending admissions and stops the prefetch thread (TransferError if it
    does not stop within `timeout` seconds, default `transfer_timeout_s`, or
    re-raising a thread failure)."""
    self._slots.cancel_pending()
    if self._spec is not None:
      self._spec.cancel_pending()
    self._finalizer.detach()
    self.prefetcher.close(self.transfer_timeout_s if timeout is None else timeout)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.close()
      return
    try:  # keep the exception already propagating; note a close failure on it
      self.close()
    except Exception as e:  # pylint: disable=broad-except
      exc.add_note(f"while handling it, OffloadEngine.close() failed: "
                   f"{type(e).__name__}: {e}")

  def transfer_stats(self) -> dict:
    """The prefetcher's counters (`Prefetcher.stats`) and whether its thread runs."""
    return dict(self.prefetcher.stats(), alive=self.prefetcher.alive,
                host_copies=self.prefetcher.host_copies)

  def held_bytes(self) -> int:
    """Bytes of expert copies the engine holds outside its slot buffers (transfers
    queued, in flight, arrived and not yet inserted)."""
    return self.prefetcher.held_bytes()

  def resident_sets(self) -> dict[int, list[int]]:
    """{MoE layer: resident experts}, after inserting every requested admission."""
    for l in self.moe_layers:
      self._slots.admit(l, carry=True)
    return {l: s.resident_experts() for l, s in self.states.items()}

  @property
  def records(self) -> list[TokenRecord]:
    """The decode steps' records, in order (deferred steps' are read first)."""
    self._read_deferred()
    return self._records

  @property
  def deferred_steps(self) -> tuple[int, int]:
    """Decode steps (lazy=True) whose records are not built yet: (packed decisions still
    on the device, at most 32; read back to the host)."""
    return len(self._tokens.unread), len(self._tokens.read)

  def _read_deferred(self):
    self._tokens.build_records(lambda rec, wall: self._records.append(
        self._finish(rec, 0.0, wall)))

  def _finish(self, rec: TokenRecord, t0: float, wall: float | None = None) -> TokenRecord:
    self._slots.attribute_evictions(rec)
    rec.finish(time.perf_counter() - t0 if wall is None else wall)
    return rec

  # -------------------------------------------------------------- warm-up
  def warmup(self):
    """Compiles every decode-path step once on throwaway inputs (state untouched), so
    that per-token statistics measure decoding, not compilation."""
    cfg = self.cfg
    x, tp = self._model.embed_decode(self.params, np.zeros(2, np.int32))
    jax.block_until_ready(self._model.head_decode(self.params, x))
    if not self._host_rows:   # the prefetch thread's device copies, per row bucket
      zero = {k: np.zeros(np.shape(v), np.asarray(v).dtype)
              for k, v in self.store.get(self.moe_layers[0], 0).items()}
      for n in range(1, cfg.top_k + 1):
        jax.block_until_ready(copies.stacked_device_put([zero] * n, self.prefetcher.sharding,
                                                        self._slots.rows(n)))
    new_kv = lambda l: self._put(init_cache(cfg, 1, self.max_len, self.dtype)[l])
    insert_s = steps_lib.warm_all(cfg, self._steps, self._fused, self.params, x, tp, new_kv,
                                  self.states, self._zero_x, self._zero_rows,
                                  self._slots.row_buckets, self._host_rows)
    self._slots.insert_s = min(self._slots.insert_s, insert_s)
    # the layer run, on throwaway copies (all resident: only the straight one is called)
    run = self._straight if self._straight is not None else self._run
    if run is not None:
      runs_lib.warm(run, self.params, self._placeholder(), self.states,
                    self._put(init_cache(cfg, 1, self.max_len, self.dtype)),
                    straight=self._straight is not None)
    if self._spec is not None:
      prefetch_lib.warm(self._layers, cfg, self.params, self.states, x, tp, new_kv,
                        self._zero_x, self._zero_rows, self._host_rows)

  def _placeholder(self):
    """The run's placeholders for a token's first call (`runs.placeholders`), built once."""
    if self._no_pend is None:
      l = self.moe_layers[0]
      self._no_pend = runs_lib.placeholders(
          self.cfg, self.dtype, self.policy, self._trim_to, self.params, self._model,
          self._put(init_cache(self.cfg, 1, self.max_len, self.dtype)[l]), self.states[l],
          self._zero_x, self._put)
    return self._no_pend

  # -------------------------------------------------------------- prefill
  def prefill(self, prompt_ids) -> np.ndarray:
    """Runs the prompt (exact for every policy); returns the last position's logits [V].

    Per MoE layer the union of the prompt's selected experts is made available
    (`prompt.moe_layer`).
    """
    self._read_deferred()
    t0 = time.perf_counter()
    rec = TokenRecord(tokens=len(prompt_ids))
    t = len(prompt_ids)
    if t < 1:
      raise ValueError("prefill needs at least one prompt token")
    if t + 1 > self.max_len:
      raise ValueError(f"prompt of {t} tokens does not fit max_len={self.max_len}")
    tb = t if families.of(self.cfg).has_recurrent_state(self.cfg) else min(bucket(t), self.max_len)
    toks = np.zeros((1, tb), np.int32)
    toks[0, :t] = prompt_ids
    self.cache = self._put(init_cache(self.cfg, 1, self.max_len, self.dtype))
    if self._spec is not None:
      self._spec.new_sequence()
    pos = self._put(np.arange(tb, dtype=np.int32)[None])
    end = self._put(np.int32(0))
    x = self._model.embed(self.params, self._put(toks))
    for i, st in enumerate(self._steps):
      p = self.params[f"layers_{i}"]
      if not self.cfg.sparse_layers[i]:
        x, self.cache[i] = st.dense(p, x, pos, self.cache[i], end)
        continue
      h, moe_in, self.cache[i], ids, gates = st.prefill_attend(p, x, pos, self.cache[i], end)
      x = prompt.moe_layer(i, st, p, h, moe_in, ids, gates, t, slots=self._slots,
                           prefetcher=self.prefetcher, physical=self.budget.physical,
                           policy=self.policy, trim_to=self._trim_to, put=self._put, rec=rec)
    out = np.asarray(self._model.head(self.params, x[:, t - 1])[0])
    self.end_index = t
    self.prefill_record = self._finish(rec, t0)
    return out

  # -------------------------------------------------------------- decode
  def decode_step(self, token, lazy: bool = False):
    """Feeds one token at position `end_index`; returns the next-token logits [V].

    `lazy=True` returns them as a device array.  When the step is one straight run
    (every expert resident, no trace, no speculative prefetch) it is deferred
    (`token_decode`): `token` may be a device int32 scalar (e.g. an argmax of the last
    logits), the call returns without waiting for the device, and its record is built
    later (`records`); its wall time is then the interval to the next step's dispatch.
    Logits, records and resident states equal a plain step's.  (The steps' packed
    decisions go to the host after 32 further steps, ~6 KB a token on the demo model;
    records are built from them when `records` or `stats` is read, or before the next
    plain step or prefill.)

    With `trace` on, the step's timeline goes to `traces`: (event, layer,
    perf_counter) marks "attend", "decided", "fetch", "arrived", "moe",
    "moe_done", "dense", "head" and "end" after "start"; with layer runs
    (run_layers=True) "run" (its first layer) and "run_done" (where it stopped;
    num_layers: the token's end, head included) around each run call, and the
    per-layer marks only for the layers the host serves.
    """
    if self.cache is None:
      raise ValueError("decode_step before prefill")
    if self.end_index >= self.max_len:
      raise ValueError(f"max_len={self.max_len} reached")
    t0 = time.perf_counter()
    rec = TokenRecord()
    if lazy and self._spec is None and not self.trace and self._tokens.can_defer():
      out = self._tokens.decode_deferred(self.params, token, self.end_index, self.cache,
                                         self._placeholder(), rec, t0)
      self.end_index += 1
      self._tokens.read_deferred(keep=32)  # the oldest, done long ago: no wait
      return out
    self._read_deferred()
    tr = [("start", -1, t0)] if self.trace else None
    mark = ((lambda ev, l: tr.append((ev, l, time.perf_counter()))) if tr is not None
            else (lambda ev, l: None))
    tp_np = np.asarray([int(token), self.end_index], np.int32)
    if self._spec is None:
      out = self._tokens.decode(self.params, tp_np, self.cache,
                                self._placeholder() if self._run is not None else None, rec,
                                mark, self.trace)
      return self._end_step(out, rec, t0, tr, lazy)
    x, tp = self._model.embed_decode(self.params, tp_np)      # speculative prefetch on
    pend = None      # a MoE layer's moe call, run inside the next MoE layer's call
    for i, st in enumerate(self._steps):
      p = self.params[f"layers_{i}"]
      if not self.cfg.sparse_layers[i]:
        mark("dense", i)
        x, self.cache[i] = st.dense_decode(p, x, tp, self.cache[i])
      else:
        x, pend = self._layers.spec_layer(i, p, x, tp, self.cache, self.params, rec, mark,
                                          pend, self.trace)
    if pend is not None:
      x = self._layers.spec_moe_call(pend, mark, self.trace)
    mark("head", -1)
    out = np.asarray(self._model.head_decode(self.params, x))
    return self._end_step(out, rec, t0, tr, lazy)

  def _end_step(self, out: np.ndarray, rec: TokenRecord, t0: float, tr, lazy: bool):
    self.end_index += 1
    self._records.append(self._finish(rec, t0))
    if tr is not None:
      tr.append(("end", -1, t0 + rec.wall_s))
      self.traces.append(tr)
    return jnp.asarray(out) if lazy else out

  def generate(self, prompt_ids, sp: SamplingParams, seed: int = 0, on_token=None) -> list[int]:
    """Prefill + up to sp.max_new_tokens sampled tokens (batch 1)."""
    t = len(prompt_ids)
    if t + sp.max_new_tokens > self.max_len:
      raise ValueError(f"prompt ({t}) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                       f"max_len={self.max_len}")
    key = jax.random.PRNGKey(seed)
    logits = self.prefill(prompt_ids)
    out = []
    for i in range(sp.max_new_tokens):
      key, sub = jax.random.split(key)
      tid = int(next_token(logits, sub, float(sp.temperature), float(sp.top_p)))
      out.append(tid)
      if on_token:
        on_token(tid)
      if tid in sp.stop_ids or i == sp.max_new_tokens - 1:
        break
      logits = self.decode_step(tid)
    return out

  def stats(self, skip: int = 0) -> dict:
    """Summary of the decode records after the first `skip` tokens (warm-up)."""
    return summarize(self.records[skip:], self.cfg)
