"""The benchmarks' side of the server: start a `launch.serve` subprocess, send it a streamed
completion over a lean keep-alive client, read its /metrics.  Used by benchmarks.serve
(TTFT and decode against launch.generate's path) and benchmarks.serve_load (the load
test), which import it and not each other.

  proc, url = start_server(model_dir, warm_len=16, policy="quality")
  conn = http.client.HTTPConnection(host, port, timeout=600)      # kept alive
  row = via_server(conn, "demo", "def f(x):", max_tokens=32)      # ttft_ms, latency_ms, ...
  m = scrape_metrics(url)      # {"moejax_time_to_first_token_seconds_sum": ..., ...}

The client is the standard library's http.client: httpx took ~0.5 ms more per first
chunk on a 2-core machine, its own parsing, not the server's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request


def start_server(model_dir: str, warm_len, policy: str, max_len: int | None = None,
                 extra=(), timeout_s: float = 600.0):
  """A `python -m launch.serve` subprocess on a free port -> (proc, url) once /health
  answers 200; RuntimeError with its log if it ends or is not ready in `timeout_s`.
  proc.log: its stderr lines so far (proc.log_reader: the thread that reads them)."""
  args = [sys.executable, "-m", "launch.serve", f"--model_dir={model_dir}", "--port=0",
          f"--policy={policy}", *extra]
  if warm_len is not None:      # else the server's default (--warm_prompt_tokens)
    args.append(f"--warm_prompt_tokens={warm_len}")
  if max_len:
    args.append(f"--max_len={max_len}")
  proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
  url, log = [], []

  def read():
    for line in proc.stderr:
      log.append(line)
      m = re.search(r"on (http://[\d.]+:\d+)", line)
      if m and not url:
        url.append(m.group(1))
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  proc.log, proc.log_reader = log, reader     # its stderr lines, as they come
  t0 = time.time()
  while time.time() - t0 < timeout_s:
    if proc.poll() is not None:
      raise RuntimeError("the server ended: " + "".join(log))
    if url and _health(url[0]) == 200:
      return proc, url[0]
    time.sleep(0.2)
  proc.terminate()
  raise RuntimeError("the server did not become healthy: " + "".join(log))


def _health(url: str) -> int | None:
  try:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
      return r.status
  except OSError:               # refused, 503 (HTTPError is an OSError), timeout
    return None


def via_server(conn, model_id: str, prompt: str, max_tokens: int, temperature: float = 0.0
               ) -> dict:
  """One streamed completion (greedy by default) on the keep-alive http.client connection `conn` ->
  ttft_ms (from just before the request is written to the line of the first chunk with
  text), latency_ms (to the end of the stream), tokens, tokens_per_s, and the server's
  own usage.moejax figures (server_ttft_ms: its prompt pass to the first token)."""
  body = json.dumps(dict(model=model_id, prompt=prompt, temperature=temperature, stream=True,
                         max_tokens=max_tokens, seed=0)).encode()
  lines, usage = [], None
  t0 = time.perf_counter()
  conn.request("POST", "/v1/completions", body=body,
               headers={"Content-Type": "application/json"})
  r = conn.getresponse()
  if r.status != 200:
    raise RuntimeError(f"the server answered {r.status}: {r.read()[:500]!r}")
  while True:
    line = r.readline()          # one SSE line, the chunked framing undone
    if not line or line.startswith(b"data: [DONE]"):
      break
    if line.startswith(b"data: {"):   # stamped when read, parsed after
      lines.append((time.perf_counter(), line))
  end = time.perf_counter()
  r.read()                       # the last chunk: the connection is free for the next one
  stamps = []
  for t, line in lines:
    chunk = json.loads(line[6:])
    if chunk.get("choices") and chunk["choices"][0]["text"]:
      stamps.append(t)
    usage = chunk.get("usage") or usage
  if usage is None or not stamps:
    raise RuntimeError(f"a stream without text or usage: {[l for _, l in lines][-3:]!r}")
  n = usage["completion_tokens"]
  server_ttft = usage["moejax"]["ttft_ms"]
  return dict(ttft_ms=1e3 * (stamps[0] - t0), latency_ms=1e3 * (end - t0), tokens=n,
              tokens_per_s=(n - 1) / (stamps[-1] - stamps[0]) if n > 1 else float("nan"),
              server_ttft_ms=server_ttft, http_ms=1e3 * (stamps[0] - t0) - server_ttft,
              server_tokens_per_s=usage["moejax"]["decode_tokens_per_s"],
              queue_ms=usage["moejax"].get("queue_ms"))


def scrape_metrics(url: str) -> dict[str, float]:
  """GET /metrics -> {sample name with its labels: value}."""
  with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
    text = r.read().decode()
  out = {}
  for line in text.splitlines():
    if line and not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      out[name] = float(value)
  return out


def summary_mean(before: dict, after: dict, name: str) -> float | None:
  """The mean of a Prometheus summary's observations between two scrapes (None when
  the server does not have it or observed nothing)."""
  s, c = f"{name}_sum", f"{name}_count"
  if s not in after or c not in after:
    return None
  n = after[c] - before.get(c, 0.0)
  return (after[s] - before.get(s, 0.0)) / n if n else None
