"""The server's Prometheus metrics (text exposition format 0.0.4), kept by hand: a few
counters and gauges need no client library.

  moejax_requests_total{outcome}          finished requests: stop, length, cancelled,
                                          timeout, error; rejected (429: queue full)
  moejax_generated_tokens_total           tokens sent
  moejax_decode_tokens_per_second         the last request's decode rate (tokens after
                                          the first / their time)
  moejax_time_to_first_token_seconds      sum and count: from the start of the request's
                                          prompt pass to its first token
  moejax_queue_wait_seconds               sum and count: from arrival to the start
  moejax_queue_depth                      requests waiting (not the running one)
  moejax_expert_hit_rate                  hits / expert calls over every decode step
  moejax_fetch_wait_seconds_total         decode time spent waiting for expert fetches
  moejax_expert_calls_total{action}       hit, substituted, fetched (waited), other
"""

from __future__ import annotations

import threading


class Metrics:

  def __init__(self):
    self._lock = threading.Lock()
    self.outcomes: dict[str, int] = {}
    self.tokens = 0
    self.decode_tps = 0.0
    self.ttft_sum, self.ttft_count = 0.0, 0
    self.wait_sum, self.wait_count = 0.0, 0
    self.fetch_wait_s = 0.0
    self.calls = {"hit": 0.0, "substituted": 0.0, "fetched": 0.0, "other": 0.0}
    self.queue_depth = lambda: 0            # set by the worker

  def outcome(self, name: str):
    with self._lock:
      self.outcomes[name] = self.outcomes.get(name, 0) + 1

  def waited(self, seconds: float):
    with self._lock:
      self.wait_sum += seconds
      self.wait_count += 1

  def finished(self, tokens: int, ttft_s: float | None, decode_tps: float | None,
               stats: dict):
    """A request's figures; `stats`: `moejax.offload.stats.summarize` of its records."""
    with self._lock:
      self.tokens += tokens
      if ttft_s is not None:
        self.ttft_sum += ttft_s
        self.ttft_count += 1
      if decode_tps is not None:
        self.decode_tps = decode_tps
      n = stats.get("tokens", 0)
      if n:
        calls = stats["expert_calls_per_token"] * n
        hit = stats["hit_rate"] * calls
        sub = stats["substituted_call_pct"] / 100 * calls
        fetched = stats["fetches_per_token"] * n
        self.calls["hit"] += hit
        self.calls["substituted"] += sub
        self.calls["fetched"] += fetched
        self.calls["other"] += max(0.0, calls - hit - sub - fetched)
        self.fetch_wait_s += stats["wait_ms_per_token"] * n / 1e3

  def render(self) -> str:
    with self._lock:
      calls = sum(self.calls.values())
      out = []

      def metric(name, kind, help_, samples):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
          out.append(f"{name}{labels} {value:.6g}")

      metric("moejax_requests_total", "counter", "Finished requests by outcome.",
             [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.outcomes.items())])
      metric("moejax_generated_tokens_total", "counter", "Tokens generated.",
             [("", self.tokens)])
      metric("moejax_decode_tokens_per_second", "gauge",
             "Decode rate of the last finished request.", [("", self.decode_tps)])
      for name, help_, s, c in (
          ("moejax_time_to_first_token_seconds", "Prompt pass to first token.",
           self.ttft_sum, self.ttft_count),
          ("moejax_queue_wait_seconds", "Arrival to start of generation.",
           self.wait_sum, self.wait_count)):
        metric(name, "summary", help_, [("_sum", s), ("_count", c)])
      metric("moejax_queue_depth", "gauge", "Requests waiting in the queue.",
             [("", self.queue_depth())])
      metric("moejax_expert_hit_rate", "gauge", "Resident-expert hits over expert calls.",
             [("", self.calls["hit"] / calls if calls else 0.0)])
      metric("moejax_fetch_wait_seconds_total", "counter",
             "Decode time spent waiting for expert fetches.", [("", self.fetch_wait_s)])
      metric("moejax_expert_calls_total", "counter", "Expert calls by action.",
             [(f'{{action="{k}"}}', v) for k, v in self.calls.items()])
      return "\n".join(out) + "\n"
