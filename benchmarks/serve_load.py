"""The server under load: `python -m launch.bench_serve --clients=8` (issue 47 item 6).

  python -m launch.bench_serve --clients=8 --requests=20 --policy=none --max_batches=1,8

For each value of --max_batches a `launch.serve` subprocess (--policy, --max_batch=B, its
other flags as a user starts it) is started.  As soon as /health answers 200 come
--bursts bursts: every client sends one request at the same moment (a barrier), and the
next burst starts once every answer of the one before is in.  The first burst is the server's first batch, so what it did not
compile before saying ready shows there (issue 62: 5.6 s a request against 0.7 s later).
Per burst the clients' mean latency (request written to the stream's end) and TTFT; the
first burst's over the later bursts' median is `first_over_later`.  /metrics is read
before and after the bursts and after the load: the server's mean TTFT and latency over
those requests against the clients' (`metrics_over_client`; the server counts from a
request's arrival, the client from just before its write, so the HTTP path is the gap).
Then --clients threads, each on its own keep-alive
connection (http.client, benchmarks.serve_client), send --requests streamed greedy
completions back to back, each with the next of a few code prompts.  Per request: time to
first token (from just before the request is written to the first chunk with text) and
its per-token latency ((last chunk - first chunk) / (tokens - 1)).  Per server:
throughput (completion tokens summed over clients / the load's wall time), p50 and p95 of
both, and the server's anonymous RSS (RssAnon) after warm-up, its peak during the load
(sampled every 50 ms) and after.  --rounds > 1 alternates the servers, so that load from
other processes falls on each alike.  The JSON holds every request's figures; the
terminal gets a table and the ratios against the first --max_batches value.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time

from absl import flags
import numpy as np

from benchmarks.serve_client import scrape_metrics, start_server, summary_mean, via_server
from moejax.cli import app as cli
from moejax.kernels import cpu_kernel

FLAGS = flags.FLAGS
PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef read_config(path):", "class Stack:\n",
           "def quicksort(xs):", "# parse the arguments\nimport argparse\n",
           "def is_prime(n):", "for line in open(path):", "def merge(a, b):")


def _rss_mb(pid: int) -> float:
  """The server's anonymous RSS (RssAnon): a mapped store's file pages are page cache, not
  the server's own memory."""
  with open(f"/proc/{pid}/status") as f:
    return int(re.search(r"RssAnon:\s+(\d+) kB", f.read()).group(1)) / 1024


def _clients_at_once(model_id: str, conns: list, burst: int) -> list[dict]:
  """One request from every client (one thread each, on its own connection) at once."""
  rows: list = [None] * len(conns)
  barrier = threading.Barrier(len(conns))

  def one(c: int):
    barrier.wait()
    rows[c] = via_server(conns[c], model_id, PROMPTS[(c + burst) % len(PROMPTS)],
                         FLAGS.max_new_tokens, FLAGS.temperature)
  threads = [threading.Thread(target=one, args=(c,)) for c in range(len(conns))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if any(r is None for r in rows):
    raise RuntimeError(f"burst {burst}: a client failed (its error is printed above)")
  return rows


def _mean(rows, key) -> float:
  return float(np.mean([r[key] for r in rows]))


def _server_vs_client(before: dict, after: dict, rows: list[dict]) -> dict:
  """/metrics' mean TTFT and latency over `rows`' requests (two scrapes around them)
  against the clients' own."""
  out = {}
  for key, name in (("ttft_ms", "moejax_time_to_first_token_seconds"),
                    ("latency_ms", "moejax_request_latency_seconds")):
    server = summary_mean(before, after, name)
    client = _mean(rows, key)
    out[key] = dict(client=client, metrics=None if server is None else 1e3 * server,
                    metrics_over_client=None if server is None else 1e3 * server / client)
  return out


def bursts(url: str, model_id: str) -> dict:
  """--bursts bursts of one request a client at once (module docstring)."""
  host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
  conns = [http.client.HTTPConnection(host, int(port), timeout=600)
           for _ in range(FLAGS.clients)]
  before = scrape_metrics(url)
  rows = [_clients_at_once(model_id, conns, i) for i in range(FLAGS.bursts)]
  after = scrape_metrics(url)
  per = [dict(latency_ms_mean=_mean(r, "latency_ms"), ttft_ms_mean=_mean(r, "ttft_ms"),
              latency_ms_max=max(x["latency_ms"] for x in r)) for r in rows]
  later = {k: float(np.median([p[k] for p in per[1:]])) for k in per[0]}
  return dict(per_burst=per, first=per[0], later_median=later,
              first_over_later={k: per[0][k] / later[k] for k in per[0]},
              server_vs_client=_server_vs_client(before, after, sum(rows, [])),
              programs_compiled=after.get("moejax_programs_compiled_total"),
              samples=rows, metrics_after=after)


def one_server(model_dir: str, model_id: str, batch: int) -> dict:
  extra = [f"--max_batch={batch}", f"--max_queue={max(FLAGS.clients * 2, 16)}",
           *FLAGS.server_args]
  proc, url = start_server(model_dir, None, FLAGS.policy, FLAGS.server_max_len, extra)
  host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
  try:
    burst = bursts(url, model_id)
    rss = {"after_warmup": _rss_mb(proc.pid)}
    peak, done = [rss["after_warmup"]], threading.Event()

    def sample():
      while not done.wait(0.05):
        peak.append(_rss_mb(proc.pid))
    threading.Thread(target=sample, daemon=True).start()
    rows: list[dict] = []
    lock = threading.Lock()

    def client(c: int):
      conn = http.client.HTTPConnection(host, int(port), timeout=600)
      for r in range(FLAGS.requests):
        out = via_server(conn, model_id, PROMPTS[(c + r) % len(PROMPTS)], FLAGS.max_new_tokens,
                         FLAGS.temperature)
        out["client"], out["ms_per_token"] = c, 1e3 / out["tokens_per_s"]
        with lock:
          rows.append(out)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(FLAGS.clients)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    wall = time.perf_counter() - t0
    done.set()
    rss.update(peak_during=max(peak), after=_rss_mb(proc.pid))
    load_vs = _server_vs_client(burst.pop("metrics_after"), scrape_metrics(url), rows)
  finally:
    proc.terminate()
    proc.wait(30)
  pct = lambda k, q: float(np.percentile([r[k] for r in rows], q))
  tokens = sum(r["tokens"] for r in rows)
  return dict(max_batch=batch, requests=len(rows), tokens=tokens, wall_s=wall,
              throughput_tok_s=tokens / wall, ttft_ms_p50=pct("ttft_ms", 50),
              ttft_ms_p95=pct("ttft_ms", 95), ms_per_token_p50=pct("ms_per_token", 50),
              ms_per_token_p95=pct("ms_per_token", 95), rss_mb=rss,
              rss_growth_mb=rss["after"] - rss["after_warmup"], bursts=burst,
              load_server_vs_client=load_vs, samples=rows)


def run() -> int:
  model_dir = FLAGS.model_dir or cli.demo_model_dir()
  model_id = os.path.basename(os.path.normpath(model_dir))
  batches = [int(b) for b in FLAGS.max_batches]
  load_start = os.getloadavg()
  runs = [one_server(model_dir, model_id, b) for _ in range(FLAGS.rounds) for b in batches]
  best = {}
  for r in runs:     # per max_batch: the round of the highest throughput
    b = r["max_batch"]
    if b not in best or r["throughput_tok_s"] > best[b]["throughput_tok_s"]:
      best[b] = r
  base = best[batches[0]]
  ratios = {b: dict(throughput=r["throughput_tok_s"] / base["throughput_tok_s"],
                    ms_per_token_p50=r["ms_per_token_p50"] / base["ms_per_token_p50"])
            for b, r in best.items()}
  res = dict(model_dir=model_dir, policy=FLAGS.policy, server_args=FLAGS.server_args,
             clients=FLAGS.clients, temperature=FLAGS.temperature, bursts=FLAGS.bursts,
             requests_per_client=FLAGS.requests, max_new_tokens=FLAGS.max_new_tokens,
             max_batches=batches, rounds=FLAGS.rounds, cpu_count=os.cpu_count(),
             cpu_kernels=cpu_kernel.describe(),
             load_avg_start=load_start, load_avg=os.getloadavg(),
             date=time.strftime("%Y-%m-%d %H:%M"), ratios_vs_first=ratios, runs=runs)
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"{FLAGS.clients} clients x {FLAGS.requests} requests, {FLAGS.max_new_tokens} tokens "
        f"each, --policy={FLAGS.policy} (load {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f})")
  print("max_batch  tok/s    x     TTFT p50/p95 ms    ms/token p50/p95   RSS growth MB")
  for b, r in best.items():
    print(f"{b:9d} {r['throughput_tok_s']:7.1f} {ratios[b]['throughput']:5.2f}x "
          f"{r['ttft_ms_p50']:8.1f} /{r['ttft_ms_p95']:8.1f} {r['ms_per_token_p50']:8.2f} /"
          f"{r['ms_per_token_p95']:7.2f} {r['rss_growth_mb']:10.1f}")
  _print_bursts(best)
  print(f"wrote {FLAGS.out}")
  return 0


def _print_bursts(best: dict):
  """The first burst against the later ones, and /metrics against the clients."""
  ratio = lambda v: "n/a" if v is None else f"{v:.3f}x"
  print(f"max_batch  bursts of {FLAGS.clients}: latency first / later ms (x)   TTFT first / "
        "later ms    /metrics over clients: TTFT, latency (bursts; load)")
  for b, r in best.items():
    bu = r["bursts"]
    f, l, x = bu["first"], bu["later_median"], bu["first_over_later"]
    sv, lv = bu["server_vs_client"], r["load_server_vs_client"]
    print(f"{b:9d} {f['latency_ms_mean']:9.1f} / {l['latency_ms_mean']:7.1f} "
          f"({x['latency_ms_mean']:.2f}x) {f['ttft_ms_mean']:12.1f} / {l['ttft_ms_mean']:7.1f}"
          f"    {ratio(sv['ttft_ms']['metrics_over_client'])}, "
          f"{ratio(sv['latency_ms']['metrics_over_client'])}; "
          f"{ratio(lv['ttft_ms']['metrics_over_client'])}, "
          f"{ratio(lv['latency_ms']['metrics_over_client'])}")
