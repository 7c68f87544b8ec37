"""The server under load: `python -m launch.bench_serve --clients=8` (issue 47 item 6).

  python -m launch.bench_serve --clients=8 --requests=20 --policy=none --max_batches=1,8

For each value of --max_batches a `launch.serve` subprocess (--policy, --max_batch=B) is
started and warmed with one request; then --clients threads, each on its own keep-alive
connection (http.client, as benchmarks.serve), send --requests streamed greedy
completions back to back, each with the next of a few code prompts.  Per request: time to
first token (from just before the request is written to the first chunk with text) and
its per-token latency ((last chunk - first chunk) / (tokens - 1)).  Per server:
throughput (completion tokens summed over clients / the load's wall time), p50 and p95 of
both, and the server's anonymous RSS (RssAnon) after warm-up, its peak during the load
(sampled every 50 ms) and after.  --rounds > 1 alternates the servers, so that load from other processes falls
on each alike.  The JSON holds every request's figures; the terminal gets a table and
the ratios against the first --max_batches value.
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

from benchmarks.serve import start_server, via_server
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


def one_server(model_dir: str, model_id: str, batch: int) -> dict:
  extra = [f"--max_batch={batch}", f"--max_queue={max(FLAGS.clients * 2, 16)}",
           *FLAGS.server_args]
  if FLAGS.server_max_len:
    extra.append(f"--max_len={FLAGS.server_max_len}")
  proc, url = start_server(model_dir, 16, extra)
  host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
  try:
    warm = http.client.HTTPConnection(host, int(port), timeout=600)
    via_server(warm, model_id, PROMPTS[0])
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
        out = via_server(conn, model_id, PROMPTS[(c + r) % len(PROMPTS)])
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
  finally:
    proc.terminate()
    proc.wait(30)
  pct = lambda k, q: float(np.percentile([r[k] for r in rows], q))
  tokens = sum(r["tokens"] for r in rows)
  return dict(max_batch=batch, requests=len(rows), tokens=tokens, wall_s=wall,
              throughput_tok_s=tokens / wall, ttft_ms_p50=pct("ttft_ms", 50),
              ttft_ms_p95=pct("ttft_ms", 95), ms_per_token_p50=pct("ms_per_token", 50),
              ms_per_token_p95=pct("ms_per_token", 95), rss_mb=rss,
              rss_growth_mb=rss["after"] - rss["after_warmup"], samples=rows)


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
             clients=FLAGS.clients,
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
  print(f"wrote {FLAGS.out}")
  return 0
