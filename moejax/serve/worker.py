"""The engine's thread: one request at a time (batch 1) from a bounded FIFO queue, or with
--max_batch > 1 several at once (continuous batching: `batching.serve`).

    w = Worker(load, metrics, max_queue=16)   # load() -> Loaded (runs on the thread)
    w.start()                                 # loads and compiles, then serves
    job = Job(ids, sp, seed, policy, stops, timeout_s, sink)
    w.submit(job)                             # QueueFull: the queue holds max_queue
    job.cancel.set()                          # the engine stops at its next token
    job.first_sent = threading.Event()        # a stream: set once its first text is written

Each job runs `OffloadEngine.generate` (`decoding.generate`: with log-probs or penalties,
the same loop with them) under its own policy (`set_policy`: the resident
experts, budget and link stay).  A policy's first use compiles its programs (the decode
step, the prompt pass of the job's bucket) before the job's clock starts, so its
tpot_ms and ttft_ms compare with later jobs'; the time is reported apart (compile_ms).  `sink`
receives ("text", str) as text becomes final, then ("done", Result) or ("error",
APIError).  A cancelled or timed-out job ends at the next token, between two engine
steps, so the engine is left as after any generation: the next prompt pass starts a
new KV cache, the resident experts carry over.

Time to first token: with `first_sent` (a stream), the engine's thread waits, after it
hands the first text to the event loop, until the loop has written it to the socket
(at most FIRST_SENT_WAIT_S) before it decodes the second token.  Decoding at once
would keep both cores of a small machine busy (the step and the CPU kernel's spinning
helper), and the event loop and the client then waited for a core: the first chunk
reached the client ~0.4-1 ms later (docs/serve.md).  The wait costs decoding one
hand-off per request, not per token.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from typing import Any, Callable

from moejax.serve import batching, protocol
from moejax.serve.jobs import Job, Result, timeout_error
from moejax.serve.text import StopText

FIRST_SENT_WAIT_S = 0.02   # the longest the engine waits for the first chunk's write


class QueueFull(Exception):
  def __init__(self, retry_after_s: int):
    super().__init__(f"retry after {retry_after_s} s")
    self.retry_after_s = retry_after_s


@dataclasses.dataclass
class Loaded:
  """What the loading step hands the worker."""
  engine: Any            # OffloadEngine
  tok: Any               # Tokenizer
  cfg: Any               # ModelConfig
  chat_template: Any     # chat.Template or None
  warmed: tuple = ()     # policies compiled at start beside the engine's (--warm_policies)


class _Stop(Exception):
  """Raised in the token callback: ends `generate` between two steps."""


class Worker:

  def __init__(self, load: Callable[[], Loaded], metrics, max_queue: int = 16,
               max_policies: int = 8, on_fail: Callable[[BaseException], None] | None = None):
    self._load, self.metrics = load, metrics
    self.max_policies = max_policies
    self._q: queue.Queue = queue.Queue(maxsize=max_queue)
    self.loaded: Loaded | None = None
    self.failed: BaseException | None = None
    self.ready = threading.Event()
    self.policies: list = []             # policies compiled, oldest first
    self._scorer = None                  # logprobs.PromptScorer, on first use
    self._on_fail = on_fail
    self._mean_s = 1.0                   # recent request time, for Retry-After
    self._thread = threading.Thread(target=self._main, daemon=True, name="moejax-engine")
    metrics.queue_depth = self._q.qsize

  def start(self):
    self._thread.start()

  def stop(self, timeout_s: float = 5.0):
    """Ends the thread after the current token (queued requests are dropped)."""
    while True:
      try:
        job = self._q.get_nowait()
      except queue.Empty:
        break
      if job is not None:
        job.sink("error", protocol.APIError(503, "the server is shutting down",
                                            "server_error", code="shutting_down"))
    try:
      self._q.put_nowait(None)
    except queue.Full:
      pass
    self._thread.join(timeout_s)

  def depth(self) -> int:
    return self._q.qsize()

  def submit(self, job: Job):
    try:
      self._q.put_nowait(job)
    except queue.Full:
      self.metrics.outcome("rejected")
      raise QueueFull(max(1, round(self._mean_s * (self._q.qsize() + 1)))) from None

  def check_policy(self, policy):
    """APIError when `policy` would be one more compiled program than --max_policies."""
    if policy in self.policies or len(self.policies) < self.max_policies:
      return
    names = "; ".join(p.describe() for p in self.policies)
    raise protocol.APIError(
        400, f"this server compiles at most {self.max_policies} policies (--max_policies) "
        f"and has compiled {names}: use one of them, or restart the server with a higher "
        f"--max_policies", param="moejax.policy", code="policy_limit")

  # ------------------------------------------------------------------ the thread
  def _main(self):
    try:
      self.loaded = self._load()
      self.policies.append(self.loaded.engine.policy)
      self.policies.extend(p for p in self.loaded.warmed if p not in self.policies)
    except BaseException as e:  # pylint: disable=broad-except
      self.failed = e
      if self._on_fail:
        self._on_fail(e)
      return
    self.metrics.count_programs()
    self.ready.set()
    if isinstance(self.loaded.engine, (batching.Resident, batching.Offloaded)):   # --max_batch
      batching.serve(self._q, self.loaded.engine, self.loaded.tok, self.metrics, self._scorer_of)
      return
    while True:
      job = self._q.get()
      if job is None:
        return
      self._serve(job)

  def _serve(self, job: Job):
    start = time.perf_counter()
    self.metrics.waited(start - job.created)
    if job.cancel.is_set():
      self.metrics.outcome("cancelled")
      return
    if start > job.deadline:
      self.metrics.outcome("timeout")
      job.sink("error", timeout_error(job, start))
      return
    try:
      result = self._generate(job, start)
    except _Timeout:
      self.metrics.outcome("timeout")
      job.sink("error", timeout_error(job, time.perf_counter()))
    except _Cancelled:
      self.metrics.outcome("cancelled")
    except protocol.APIError as e:
      self.metrics.outcome("error")
      job.sink("error", e)
    except Exception as e:  # pylint: disable=broad-except
      self.metrics.outcome("error")
      print(f"[moejax] error in a request: {type(e).__name__}: {e}", file=sys.stderr)
      job.sink("error", protocol.APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                          "server_error"))
    else:
      self.metrics.outcome(result.finish_reason)
      job.sink("done", result)
    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - start)

  def _scorer_of(self):
    """The prompt scorer (`logprobs.PromptScorer`), made on first use."""
    if self._scorer is None:
      from moejax.serve.logprobs import PromptScorer
      eng = self.loaded.engine
      self._scorer = PromptScorer(self.loaded.cfg, eng.params, eng.store, eng.dtype)
    return self._scorer

  def _generate(self, job: Job, start: float) -> Result:
    from moejax.offload.stats import summarize
    from moejax.serve import decoding
    eng, tok = self.loaded.engine, self.loaded.tok
    eng.set_policy(job.policy)
    compile_s = 0.0
    if job.policy not in self.policies:   # its first use: compile before the clock starts
      t = time.perf_counter()
      eng.warmup(prompt_lengths=(len(job.prompt_ids),))
      compile_s = time.perf_counter() - t
      self.policies.append(job.policy)
      self.metrics.compiled(compile_s)
    eng.take_records()
    text = StopText(tok, job.stops)
    out: list[int] = []
    times: list[float] = []
    state = {"end": None}
    first_sent = job.first_sent

    def on_token(tid):
      nonlocal first_sent
      times.append(time.perf_counter())
      out.append(int(tid))
      delta = text.add(tid)
      if delta:
        job.sink("text", delta)
        if first_sent is not None:       # let the loop write the first chunk on a free core
          first_sent.wait(FIRST_SENT_WAIT_S)
          first_sent = None
      if text.stopped:
        state["end"] = "stop"
        raise _Stop
      if job.cancel.is_set():
        raise _Cancelled
      if times[-1] > job.deadline:
        raise _Timeout

    t0 = time.perf_counter()
    lps = [] if job.logprobs is not None else None
    try:
      decoding.generate(eng, job.prompt_ids, job.sp, job.seed, on_token, top=job.logprobs,
                        logprobs=lps, presence=job.presence, frequency=job.frequency)
    except _Stop:
      pass
    finally:
      records = eng.take_records()
    rest = text.finish()
    if rest:
      job.sink("text", rest)
    if state["end"] is None:
      state["end"] = "stop" if out and out[-1] in job.sp.stop_ids else "length"
    stats = summarize(records, self.loaded.cfg)
    ttft = times[0] - t0 if times else None
    tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and \
        times[-1] > times[0] else None
    # /metrics from the arrival (the queue and a policy's compile included: its client
    # waits for them); usage.moejax's ttft_ms from the prompt pass
    end = times[-1] if times else time.perf_counter()
    self.metrics.finished(len(out), times[0] - job.created if times else None, tps, records,
                          latency_s=end - job.created)
    offload = protocol.offload_usage(stats, eng, job.policy, ttft, tps,
                                     t0 - job.created - compile_s, compile_s)
    prompt_lps = None
    if job.score_prompt:              # after the timed part: ttft and tpot stay comparable
      prompt_lps = self._scorer_of()(job.prompt_ids, job.logprobs or 0)
    return Result(out, state["end"], len(job.prompt_ids), offload,
                  None if lps is None else lps[:len(out)], prompt_lps)


class _Cancelled(Exception):
  pass


class _Timeout(Exception):
  pass
