"""A request as the engine's thread sees it: the `Job` the HTTP handler queues, the
`Result` its sink receives, and the error of a job past its deadline.  The one-at-a-time
loop (`worker`) and continuous batching (`batching`) both run them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from moejax.serve import protocol

@dataclasses.dataclass
class Result:
  text_tokens: list[int]
  finish_reason: str         # stop, length
  prompt_tokens: int
  offload: dict              # usage.moejax
  logprobs: list | None = None         # per generated token: (lp, [(id, lp)]) (Job.logprobs)
  prompt_logprobs: list | None = None  # per prompt token: None, then (lp, [(id, lp)])


@dataclasses.dataclass
class Job:
  prompt_ids: list[int]
  sp: Any                    # SamplingParams
  seed: int
  policy: Any                # PolicyParams
  stops: list[str]
  timeout_s: float
  sink: Callable[[str, Any], None]
  # its arrival (perf_counter; the HTTP handler passes when it began): the deadline, the
  # queue wait and /metrics' TTFT and latency count from it
  created: float = dataclasses.field(default_factory=time.perf_counter)
  cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
  first_sent: threading.Event | None = None   # a stream: see worker.py, FIRST_SENT_WAIT_S
  logprobs: int | None = None     # the top log-probs per token (0-5); None: none
  score_prompt: bool = False      # the prompt's log-probs too (echo), exact
  presence: float = 0.0           # OpenAI's penalties
  frequency: float = 0.0

  @property
  def deadline(self) -> float:
    return self.created + self.timeout_s


def timeout_error(job: Job, now: float) -> protocol.APIError:
  return protocol.APIError(
      504, f"the request timed out after {now - job.created:.1f} s (timeout "
      f"{job.timeout_s:g} s; set moejax.timeout_s, up to the server's --request_timeout_s)",
      "timeout_error", code="timeout")
