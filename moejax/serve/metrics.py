"""The server's Prometheus metrics (text exposition format 0.0.4), kept by hand: a few
counters and gauges need no client library.  Counts are integers, rendered exactly.

  moejax_requests_total{outcome}          completion requests by how they ended: stop,
                                          length, cancelled (the client left), timeout
                                          (504), error (500), rejected (429: queue
                                          full), invalid (400: the request was refused),
                                          unavailable (503: loading, or failed to load)
  moejax_http_responses_total{code}       every HTTP answer, any route, by status code
  moejax_generated_tokens_total           tokens sent
  moejax_decode_tokens_per_second         the last request's decode rate (tokens after
                                          the first / their time)
  moejax_time_to_first_token_seconds      sum and count: from the request's arrival (its
                                          first byte handled) to its first token: the
                                          queue, a batch's other joins and its prompt
                                          pass, as its client waits (usage.moejax.ttft_ms
                                          is its prompt pass to its first token)
  moejax_request_latency_seconds          sum and count: from arrival to its last token
  moejax_queue_wait_seconds               sum and count: from arrival to the start
  moejax_queue_depth                      requests waiting (not the running one)
  moejax_programs_compiled_total          programs jax built after the server said ready
                                          (lowered, then compiled or read from the
                                          persistent cache): a new policy's, a prompt
                                          bucket's or a sampler setting's first use; 0
                                          for requests the start-up warmed (issue 62)
  moejax_program_compile_seconds_total    ... their lowering and compile time
  moejax_policy_compiles_total            policies compiled on a request's first use
  moejax_policy_compile_seconds_total     ... their compile time (outside the requests'
                                          ttft and tpot)
  moejax_expert_hit_rate                  hits / expert calls over every decode step
  moejax_fetch_wait_seconds_total         decode time spent waiting for expert fetches (a
                                          batch's step counted once, not once a row)
  moejax_expert_calls_total{action}       hit, substituted, fetched (waited; full
                                          precision), other (low-precision fetches,
                                          dropped, computed on the host); they sum to
                                          the expert calls
"""

from __future__ import annotations

import threading

CALLS = ("hit", "substituted", "fetched", "other")
# jax.monitoring's events of a program built: lowered (each build), compiled (unless the
# persistent cache had it)
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILED = "/jax/core/compile/backend_compile_duration"


def expert_calls(records) -> dict[str, int]:
  """Expert calls of decode records (`moejax.offload.stats.TokenRecord`) by action, as
  integers: each is a sum of the records' whole counts (no share is subtracted)."""
  total = lambda *keys: int(round(sum(r[k] for r in records for k in keys)))
  return {"hit": total("hits"), "substituted": total("substituted"),
          "fetched": total("fetches"), "other": total("fetches_low", "dropped", "host_calls")}


def _sample(value) -> str:
  return str(value) if isinstance(value, int) else repr(float(value))


class Metrics:

  def __init__(self):
    self._lock = threading.Lock()
    self.outcomes: dict[str, int] = {}
    self.responses: dict[int, int] = {}
    self.tokens = 0
    self.decode_tps = 0.0
    self.ttft_sum, self.ttft_count = 0.0, 0
    self.latency_sum, self.latency_count = 0.0, 0
    self.wait_sum, self.wait_count = 0.0, 0
    self.compile_s, self.compiles = 0.0, 0
    self.programs, self.program_s = 0, 0.0
    self.fetch_wait_s = 0.0
    self.calls = dict.fromkeys(CALLS, 0)
    self.queue_depth = lambda: 0            # set by the worker

  def count_programs(self):
    """From now on (the server is ready), every program jax builds counts in
    moejax_programs_compiled_total and its time in moejax_program_compile_seconds_total."""
    import jax.monitoring

    def on_event(event: str, seconds: float, **_):
      if event in (LOWERED, COMPILED):
        with self._lock:
          self.programs += event == LOWERED
          self.program_s += seconds
    jax.monitoring.register_event_duration_secs_listener(on_event)

  def outcome(self, name: str):
    with self._lock:
      self.outcomes[name] = self.outcomes.get(name, 0) + 1

  def responded(self, status: int):
    with self._lock:
      self.responses[status] = self.responses.get(status, 0) + 1

  def waited(self, seconds: float):
    with self._lock:
      self.wait_sum += seconds
      self.wait_count += 1

  def compiled(self, seconds: float):
    with self._lock:
      self.compile_s += seconds
      self.compiles += 1

  def finished(self, tokens: int, ttft_s: float | None, decode_tps: float | None, records,
               latency_s: float | None = None):
    """A request's figures, ttft_s and latency_s from its arrival (`Job.created`);
    `records`: its decode steps' `TokenRecord`s."""
    calls = expert_calls(records)
    wait_s = sum(r.wait_s / r.rows for r in records)   # a batch's step waited once
    with self._lock:
      self.tokens += tokens
      if ttft_s is not None:
        self.ttft_sum += ttft_s
        self.ttft_count += 1
      if latency_s is not None:
        self.latency_sum += latency_s
        self.latency_count += 1
      if decode_tps is not None:
        self.decode_tps = decode_tps
      for k, v in calls.items():
        self.calls[k] += v
      self.fetch_wait_s += wait_s

  def render(self) -> str:
    with self._lock:
      calls = sum(self.calls.values())
      out = []

      def metric(name, kind, help_, samples):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
          out.append(f"{name}{labels} {_sample(value)}")

      metric("moejax_requests_total", "counter", "Completion requests by outcome.",
             [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.outcomes.items())])
      metric("moejax_http_responses_total", "counter", "HTTP answers by status code.",
             [(f'{{code="{k}"}}', v) for k, v in sorted(self.responses.items())])
      metric("moejax_generated_tokens_total", "counter", "Tokens generated.",
             [("", self.tokens)])
      metric("moejax_decode_tokens_per_second", "gauge",
             "Decode rate of the last finished request.", [("", self.decode_tps)])
      for name, help_, s, c in (
          ("moejax_time_to_first_token_seconds", "Arrival to first token.",
           self.ttft_sum, self.ttft_count),
          ("moejax_request_latency_seconds", "Arrival to last token.",
           self.latency_sum, self.latency_count),
          ("moejax_queue_wait_seconds", "Arrival to start of generation.",
           self.wait_sum, self.wait_count)):
        metric(name, "summary", help_, [("_sum", s), ("_count", c)])
      metric("moejax_queue_depth", "gauge", "Requests waiting in the queue.",
             [("", int(self.queue_depth()))])
      metric("moejax_programs_compiled_total", "counter",
             "Programs built after the server said ready.", [("", self.programs)])
      metric("moejax_program_compile_seconds_total", "counter",
             "Their lowering and compile time.", [("", self.program_s)])
      metric("moejax_policy_compiles_total", "counter",
             "Policies compiled on a request's first use.", [("", self.compiles)])
      metric("moejax_policy_compile_seconds_total", "counter",
             "Their compile time, outside the requests' ttft and tpot.",
             [("", self.compile_s)])
      metric("moejax_expert_hit_rate", "gauge", "Resident-expert hits over expert calls.",
             [("", self.calls["hit"] / calls if calls else 0.0)])
      metric("moejax_fetch_wait_seconds_total", "counter",
             "Decode time spent waiting for expert fetches.", [("", self.fetch_wait_s)])
      metric("moejax_expert_calls_total", "counter", "Expert calls by action.",
             [(f'{{action="{k}"}}', v) for k, v in self.calls.items()])
      return "\n".join(out) + "\n"
