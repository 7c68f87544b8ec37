"""Continuous batching (`moejax-serve --max_batch=N`): up to N requests decode together,
one token of each per step, with every expert resident (`Resident`, --policy=none) or
under an offload policy (`Offloaded`: `offload.batch.Batched`, the rows sharing the
resident experts, each missed expert copied once per step for every row that needs it).

On a CPU a decode step reads every weight it uses once, whether it serves 1 token or 8,
so a step of 8 rows costs little more than a step of 1 and the server's throughput grows
with the batch (docs/serve.md has the figures).  A request joins at the next token
boundary: its prompt pass runs alone (batch 1, bucketed lengths as ever, its KV cache
sized to the bucket) and fills the first positions of a free row of the batch's cache
(`model.put_row`); each row decodes at its own position (`Sampler.decode_step` with a
position per row), and a free row decodes at position 0, unread.  A request leaves when it
stops, reaches its max_tokens, is cancelled or times out; its row is free at the next step.  One program serves every
batch: the step is compiled for N rows once, whatever the rows hold.

Each row samples with its own parameters, seed (the key schedule of `sampler.token_loop`),
penalties and log-probabilities, so a request's tokens are those it gets decoded alone:
its greedy text equals its text at --max_batch=1 (tests/test_serve_batch.py); under an
offload policy that holds with fetch_all, and otherwise a row's experts depend on what
the other rows' tokens left in the cache.  With --policy=none requests carry no policy
(their policy fields are ignored and listed in usage.moejax.ignored).  Under an offload
policy the batch runs one policy at a time: a request whose policy differs from the
running rows' waits (and the requests behind it with it) until those rows finish, then
the batch switches (`Batched.set_policy`; its first use compiles, reported apart in
usage.moejax.compile_ms).  One step's rows share one program, so one policy per step.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.model import init_cache, put_row
from moejax.model.sampler import (Sampler, SamplingParams, bucket, decode_logits, next_token,
                                  next_token_penalized)
from moejax.serve import protocol, warm
from moejax.serve.logprobs import token_logprob
from moejax.serve.text import StopText
from moejax.serve.jobs import Result, timeout_error

POLICY = "none (every expert resident)"


@dataclasses.dataclass
class Resident:
  """What --policy=none loads: the resident model (a `Sampler` over every expert) and the
  batch it decodes."""
  sampler: Sampler
  store: Any             # io.store.ExpertStore (the prompt scorer reads it)
  max_batch: int
  policy: Any = None     # requests carry no policy

  @property
  def params(self):
    return self.sampler.params

  @property
  def dtype(self):
    return self.sampler.dtype

  @property
  def max_len(self) -> int:
    return self.sampler.max_len

  def describe(self) -> str:
    return f"every expert resident (--policy=none), up to {self.max_batch} requests a step"

  def new_cache(self):
    """Placed on the device, as every cache after a join or step is: one `put_row`
    program for the first join and the later ones (an unplaced cache compiled its own)."""
    return jax.device_put(init_cache(self.sampler.cfg, self.max_batch, self.max_len, self.dtype),
                          jax.devices()[0])

  def step(self, cache, tokens_B, pos_B, valid_B=None):
    """One token of every row -> (logits [B, V] on the host, cache); a free row decodes at
    position 0, unread (valid_B is not needed)."""
    del valid_B
    s = self.sampler
    logits, cache = decode_logits(s.model, s.params, s.experts, cache, tokens_B, pos_B)
    return np.asarray(logits), cache

  def prompt(self, ids: list[int], cache, row: int):
    """A joining request's prompt pass into `row` -> (its last logits [V], cache)."""
    logits, cache_1 = self.sampler.prefill(np.asarray([ids], np.int32), fit=True)
    return logits[0], put_row(cache, cache_1, np.int32(row))

  def warmup(self, prompt_lengths=()):
    """Compiles the batch step, the row write and the prompt pass of each length's bucket
    (by running them; the cache is a throwaway), and the sampler (`warm.sampling`)."""
    cache = self.new_cache()
    one_each = {bucket(n): n for n in prompt_lengths if 0 < n < self.max_len}
    for n in sorted(one_each.values()):
      _, cache = self.prompt([0] * n, cache, 0)
    warm.sampling(self.sampler.cfg.vocab_size)
    zeros = np.zeros(self.max_batch, np.int32)
    jax.block_until_ready(self.step(cache, zeros, zeros))

  last_prompt_fetches = None

  def use_policy(self, policy) -> float:
    return 0.0

  def take_records(self) -> list:
    return []

  def usage(self, row: "Row", ttft_s, tps) -> dict:
    return {"policy": POLICY, "decode_steps": max(len(row.times) - 1, 0),
            "tpot_ms": None if tps is None else round(1e3 / tps, 3),
            "ttft_ms": None if ttft_s is None else round(1e3 * ttft_s, 3),
            "decode_tokens_per_s": None if tps is None else round(tps, 3),
            "queue_ms": round(1e3 * (row.t0 - row.job.created), 3), "compile_ms": 0.0}


class Offloaded:
  """What an offload policy with --max_batch > 1 loads: the engine's `Batched` decoder
  (its state lives there; the cache argument the loop passes is a placeholder)."""

  def __init__(self, engine, max_batch: int):
    self.engine, self.max_batch = engine, max_batch
    self.batch = engine.batched(max_batch)
    self.warm = ()
    self.seen = [engine.policy]          # policies whose programs are compiled
    # what the prompt scorer and the loop read, as `Resident` has them
    self.params, self.dtype, self.store = engine.params, engine.dtype, engine.store
    self.max_len = engine.max_len

  @property
  def policy(self):
    return self.engine.policy

  def describe(self) -> str:
    return f"{self.engine.describe()}; up to {self.max_batch} requests a step"

  def new_cache(self):
    self.batch.reset()

  def step(self, cache, tokens_B, pos_B, valid_B):
    return self.batch.step(tokens_B, valid_B), cache

  def prompt(self, ids: list[int], cache, row: int):
    return self.batch.prompt(ids, row), cache

  @property
  def last_prompt_fetches(self):
    return self.batch.last_prompt_fetches

  def warmup(self, prompt_lengths=()):
    """Compiles the B-row step, the prompt pass and the row write of each length's
    bucket (nothing runs: the resident experts stay as they are), and the sampler."""
    self.warm = tuple(prompt_lengths)
    self.batch.warmup(prompt_lengths)
    warm.joins(self.engine, self.max_batch, prompt_lengths)
    warm.sampling(self.engine.cfg.vocab_size)

  def use_policy(self, policy) -> float:
    """Switches the batch (no row running) to `policy` -> seconds spent compiling it."""
    self.batch.set_policy(policy)
    if policy in self.seen:
      return 0.0
    t0 = time.perf_counter()
    self.batch.warmup(self.warm)
    self.seen.append(policy)
    return time.perf_counter() - t0

  def take_records(self) -> list:
    return self.batch.take_records(layers=False)

  def usage(self, row: "Row", ttft_s, tps) -> dict:
    from moejax.offload.stats import summarize
    return protocol.offload_usage(summarize(row.records, self.engine.cfg), self.engine,
                                  self.policy, ttft_s, tps, row.t0 - row.job.created,
                                  row.compile_s, prompt_fetches=row.prompt_fetches)



class Row:
  """One request in the batch: its sampling state and what it has produced."""

  def __init__(self, job, tok, t0: float):
    self.job, self.t0 = job, t0
    self.key = None            # made at the first sampled token: a greedy row never reads it
    self.text = StopText(tok, job.stops)
    self.out: list[int] = []
    self.times: list[float] = []
    self.pos = len(job.prompt_ids)
    self.lps = [] if job.logprobs is not None else None
    self.penalized = job.presence != 0 or job.frequency != 0
    self.counts = None
    self.end: str | None = None
    self.shared = 0            # rows decoded in its steps, summed (usage: batch_mean)
    self.records: list = []    # its decode steps' `stats.TokenRecord`s (offload policies)
    self.compile_s = 0.0       # its policy's first use compiled the batch's programs
    self.prompt_fetches = None

  def pick(self, logits_V) -> int:
    """The next token from its step's logits: `token_loop`'s key schedule and `next_token`
    (with penalties: `next_token_penalized`, as `serve.decoding`)."""
    sp: SamplingParams = self.job.sp
    greedy = sp.temperature == 0.0 and not self.penalized
    if not greedy:             # a greedy row's key is never read: no key, no split (dispatches)
      if self.key is None:
        self.key = jax.random.PRNGKey(self.job.seed)
      self.key, sub = jax.random.split(self.key)
    if self.penalized:
      if self.counts is None:
        self.counts = jnp.zeros((np.shape(logits_V)[-1],), jnp.int32)
      tid, self.counts = next_token_penalized(
          logits_V, self.counts, sub, np.float32(self.job.presence),
          np.float32(self.job.frequency), float(sp.temperature), float(sp.top_p))
    elif greedy:
      tid = np.argmax(logits_V)        # jnp.argmax's choice (the first of equal maxima)
    else:
      tid = next_token(logits_V, sub, float(sp.temperature), float(sp.top_p))
    tid = int(tid)
    if self.lps is not None:
      self.lps.append(token_logprob(logits_V, tid, self.job.logprobs))
    return tid

  def emit(self, tid: int, now: float) -> str | None:
    """Hands the token's text on; the reason the request ends here, or None."""
    job = self.job
    self.times.append(now)
    self.out.append(tid)
    delta = self.text.add(tid)
    if delta:
      job.sink("text", delta)
    if self.text.stopped or tid in job.sp.stop_ids:
      return "stop"
    if len(self.out) >= job.sp.max_new_tokens:
      return "length"
    if job.cancel.is_set():
      return "cancelled"
    if now > job.deadline:
      return "timeout"
    self.pos += 1
    return None


def serve(q: queue.Queue, res, tok, metrics, scorer) -> None:
  """The engine thread's loop over a batch (`Resident` or `Offloaded`): admits queued
  requests into free rows at each token boundary (blocking only when no row is busy), then
  decodes one step of every busy row.  A request under another policy than the batch's
  waits for the busy rows to finish (module docstring).  Returns when the worker is
  stopped (None in its queue `q`); scorer(): the prompt scorer (`logprobs.PromptScorer`,
  made on first use)."""
  batch = _Loop(res, tok, metrics, scorer)
  while batch.admit(q):
    batch.step()


class _Loop:
  """`serve`'s state: the rows, their next tokens and positions, the batch's cache."""

  def __init__(self, res, tok, metrics, scorer):
    self.res, self.tok, self.metrics, self.scorer = res, tok, metrics, scorer
    self.cache = res.new_cache()
    self.rows: list[Row | None] = [None] * res.max_batch
    self.tokens = np.zeros(res.max_batch, np.int32)
    self.pos = np.zeros(res.max_batch, np.int32)
    self.held = None                               # a request waiting for its policy

  def admit(self, q: queue.Queue) -> bool:
    """Queued requests into the free rows; False once the worker is stopped."""
    res, rows = self.res, self.rows
    for b in range(res.max_batch):
      if rows[b] is not None:
        continue
      if self.held is not None:
        if any(rows):
          break
        job, self.held = self.held, None
      else:
        try:
          job = q.get(block=not any(rows))
        except queue.Empty:
          break
      if job is None:
        _stop_all(rows)
        return False
      if res.policy is not None and job.policy != res.policy and any(rows):
        self.held = job
        break
      self.join(job, b)
    return True

  def join(self, job, b: int) -> None:
    """`job`'s prompt pass into row b and its first token (it may end there)."""
    res, metrics = self.res, self.metrics
    start = time.perf_counter()
    metrics.waited(start - job.created)
    if job.cancel.is_set():
      metrics.outcome("cancelled")
      return
    if start > job.deadline:
      metrics.outcome("timeout")
      job.sink("error", timeout_error(job, start))
      return
    row = Row(job, self.tok, start)
    try:
      if res.policy is not None and job.policy != res.policy:
        row.compile_s = res.use_policy(job.policy)
        if row.compile_s:
          metrics.compiled(row.compile_s)
        row.t0 = time.perf_counter()
      logits, self.cache = res.prompt(job.prompt_ids, self.cache, b)
      row.prompt_fetches = res.last_prompt_fetches
      if job.sp.max_new_tokens == 0:
        row.end = "length"
      else:
        row.end = row.emit(row.pick(np.asarray(logits)), time.perf_counter())
    except Exception as e:  # pylint: disable=broad-except
      _fail(metrics, row, e)
      return
    if row.end is not None:
      _finish(metrics, res, row, self.scorer)
    else:
      self.rows[b], self.tokens[b], self.pos[b] = row, row.out[-1], row.pos - 1

  def step(self) -> None:
    """One token of every busy row; a row that ends leaves."""
    rows, res = self.rows, self.res
    busy = [b for b, r in enumerate(rows) if r is not None]
    if not busy:
      return
    try:
      logits, self.cache = res.step(self.cache, self.tokens, self.pos,
                                    np.asarray([r is not None for r in rows]))
    except Exception as e:  # pylint: disable=broad-except
      for b in busy:
        _fail(self.metrics, rows[b], e)
        rows[b] = None
      self.cache = res.new_cache()
      return
    now = time.perf_counter()
    for b, rec in zip(busy, res.take_records() or [None] * len(busy)):
      row = rows[b]
      row.shared += len(busy)
      if rec is not None:
        row.records.append(rec)
      row.end = row.emit(row.pick(logits[b]), now)
      if row.end is None:
        self.tokens[b], self.pos[b] = row.out[-1], row.pos - 1
      else:
        _finish(self.metrics, res, row, self.scorer)
        rows[b], self.tokens[b], self.pos[b] = None, 0, 0


def _finish(metrics, res, row: Row, scorer) -> None:
  job = row.job
  if row.end == "cancelled":
    metrics.outcome("cancelled")
    return
  if row.end == "timeout":
    metrics.outcome("timeout")
    job.sink("error", timeout_error(job, row.times[-1]))
    return
  rest = row.text.finish()
  if rest:
    job.sink("text", rest)
  t = row.times
  ttft = t[0] - row.t0 if t else None      # usage: its prompt pass to its first token
  tps = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None
  # /metrics: from its arrival, as its client waits (the queue, other rows' joins)
  metrics.finished(len(row.out), t[0] - job.created if t else None, tps, row.records,
                   latency_s=(t[-1] if t else time.perf_counter()) - job.created)
  usage = dict(res.usage(row, ttft, tps), batch_mean=round(row.shared / max(len(t) - 1, 1), 3))
  prompt_lps = scorer()(job.prompt_ids, job.logprobs or 0) if job.score_prompt else None
  metrics.outcome(row.end)
  job.sink("done", Result(row.out, row.end, len(job.prompt_ids), usage,
                          None if row.lps is None else row.lps[:len(row.out)], prompt_lps))


def _fail(metrics, row: Row, e: BaseException) -> None:
  metrics.outcome("error")
  print(f"[moejax] error in a request: {type(e).__name__}: {e}", file=sys.stderr)
  row.job.sink("error", protocol.APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                          "server_error"))


def _stop_all(rows) -> None:
  for r in rows:
    if r is not None:
      r.job.sink("error", protocol.APIError(503, "the server is shutting down",
                                            "server_error", code="shutting_down"))
