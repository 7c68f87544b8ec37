"""Time to first token and decode tokens/s through launch.serve against launch.generate's
own path, in the same run, on the same machine.

  python -m launch.bench_serve --out=bench_serve.json        # the demo model, quality

launch.generate's path is run in this process as that program runs it: the same
`calibrated_link`, `OffloadEngine` and `eng.generate(ids, sp, on_token=...)` with the
program's KV cache size (prompt + new tokens, rounded up to 64).  The server runs as a
`python -m launch.serve` subprocess on 127.0.0.1 and is read with streamed requests over
one keep-alive connection by a lean client (the standard library's http.client: httpx
took ~0.5 ms more per first chunk on this machine, its own parsing, not the server's).
Both are warmed with one generation first (the prompt pass compiles per prompt bucket),
then --repeats generations alternate between the two, so that load from other processes
falls on both alike.  Per generation: TTFT (from the call, or from just before the
request is written, to the first token in on_token, or to the line of the first chunk
with text read from the socket) and decode tokens/s ((tokens - 1) / (last token - first
token)); for the server also its own TTFT (usage.moejax.ttft_ms: the prompt pass to the
first token in the engine's thread) and the difference, the HTTP path's share.  The
JSON holds every sample and the medians.
"""

from __future__ import annotations

import json
import os
import time

from absl import flags
import numpy as np

from benchmarks.serve_client import start_server, via_server
from moejax.cli import app as cli

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "Model folder (default: the demo model).")
flags.DEFINE_string("policy", "quality", "Offload policy of both.")
flags.DEFINE_string("prompt", "def fibonacci(n):", "Prompt.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens per generation (greedy).")
flags.DEFINE_integer("repeats", 8, "Timed generations of each.")
flags.DEFINE_integer("server_max_len", None, "The server's --max_len (default: its own, the "
                     "model's limit up to 2048).")
flags.DEFINE_float("pause_s", 0.05, "Pause before each timed generation.")
flags.DEFINE_string("out", "bench_serve.json", "JSON output.")
flags.DEFINE_integer("clients", 0, "> 0: the load test instead (benchmarks.serve_load): this "
                     "many concurrent clients, each sending --requests streamed requests, "
                     "against a server per --max_batches value.")
flags.DEFINE_integer("requests", 20, "Requests per client (--clients).")
flags.DEFINE_list("max_batches", ["1", "8"], "The servers' --max_batch values (--clients).")
flags.DEFINE_integer("rounds", 1, "Rounds over --max_batches, alternating (--clients).")
flags.DEFINE_list("server_args", [], "More flags for the server (--clients), e.g. "
                  "--store=mmap,--dtype=bfloat16.")
flags.DEFINE_float("temperature", 0.0, "The load test's requests (--clients): 0 greedy, 1 "
                   "OpenAI's default sampling (what the openai client sends unless told).",
                   lower_bound=0.0)
flags.DEFINE_integer("bursts", 4, "Before the load (--clients): bursts of one request from "
                     "every client at once, the first sent as soon as the server is ready "
                     "(its first batch: what it compiled before saying ready), each after "
                     "the last answer of the one before.", lower_bound=2)


def via_generate(eng, ids, sp):
  stamps = []
  t0 = time.perf_counter()
  out = eng.generate(ids, sp, seed=0, on_token=lambda t: stamps.append(time.perf_counter()))
  eng.take_records()
  n = len(out)
  return dict(ttft_ms=1e3 * (stamps[0] - t0), tokens=n,
              tokens_per_s=(n - 1) / (stamps[-1] - stamps[0]))


def main(_):
  if FLAGS.clients > 0:
    from benchmarks import serve_load
    return serve_load.run()
  import jax
  import jax.numpy as jnp
  from moejax.cache.policy import make_policy
  from moejax.io.loader import load_model
  from moejax.io.store import make_store
  from moejax.io.tokenizer import Tokenizer
  from moejax.model.sampler import SamplingParams, bucket
  from moejax.offload.calibrate import calibrated_link
  from moejax.offload.engine import EngineConfig, OffloadEngine
  model_dir = FLAGS.model_dir or cli.demo_model_dir()
  tok = Tokenizer(model_dir)
  ids = tok.encode(FLAGS.prompt)
  proc, url = start_server(model_dir, len(ids), FLAGS.policy, FLAGS.server_max_len)
  try:
    cfg, params, experts = load_model(model_dir, dtype=jnp.float32)
    store = make_store(experts, "numpy")
    from moejax.offload.link import default_spec
    spec = default_spec(jax.devices()[0].platform)
    link = calibrated_link(spec, cfg, params, store, jnp.float32)
    need = len(ids) + FLAGS.max_new_tokens        # launch.generate's sequence_length
    seq = min(cfg.max_position_embeddings, max(need, bucket(need, minimum=64)))
    sp = SamplingParams(0.0, 1.0, FLAGS.max_new_tokens, tuple(cfg.eos_token_ids))
    model_id = os.path.basename(os.path.normpath(model_dir))
    config = EngineConfig.make(make_policy(FLAGS.policy), cache_fraction=0.25, link=link,
                               max_len=seq, dtype=jnp.float32)
    with OffloadEngine(cfg, params, store, config) as eng:
      eng.warmup()
      via_generate(eng, ids, sp)                  # the prompt pass compiles
      import http.client
      host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
      conn = http.client.HTTPConnection(host, int(port), timeout=600)   # kept alive
      via_server(conn, model_id, FLAGS.prompt, FLAGS.max_new_tokens)
      rows = {"generate": [], "server": []}
      load_start = os.getloadavg()
      for _ in range(FLAGS.repeats):
        # a pause before each: neither starts while the other's tail (the server's last
        # writes and bookkeeping, the client's parsing) still runs
        time.sleep(FLAGS.pause_s)
        rows["generate"].append(via_generate(eng, ids, sp))
        time.sleep(FLAGS.pause_s)
        rows["server"].append(via_server(conn, model_id, FLAGS.prompt, FLAGS.max_new_tokens))
  finally:
    proc.terminate()
    proc.wait(30)
  med = {k: {m: float(np.median([r[m] for r in v])) for m in v[0]
             if isinstance(v[0][m], (int, float))} for k, v in rows.items()}
  ratio = {m: med["server"][m] / med["generate"][m] for m in ("ttft_ms", "tokens_per_s")}
  # the median of the ratios of the alternating pairs: load that drifts over the run
  # falls on both of a pair alike
  paired = {m: float(np.median([s[m] / g[m] for g, s in zip(rows["generate"], rows["server"])]))
            for m in ("ttft_ms", "tokens_per_s")}
  res = dict(model_dir=model_dir, policy=FLAGS.policy, prompt_tokens=len(ids),
             max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats, link=link.describe(),
             generate_max_len=seq, server_max_len=FLAGS.server_max_len or
             min(cfg.max_position_embeddings, 2048), platform=jax.devices()[0].platform,
             cpu_count=os.cpu_count(), load_avg_start=load_start, load_avg=os.getloadavg(),
             date=time.strftime("%Y-%m-%d %H:%M"), client="http.client, one keep-alive "
             "connection", median=med, server_over_generate=ratio,
             server_over_generate_paired_median=paired, samples=rows)
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
  for k in ("generate", "server"):
    print(f"{k:9s} TTFT {med[k]['ttft_ms']:8.2f} ms   decode {med[k]['tokens_per_s']:8.1f} "
          f"tokens/s")
  print(f"server's own TTFT {med['server']['server_ttft_ms']:.2f} ms, the HTTP path "
        f"{med['server']['http_ms']:.2f} ms (medians)")
  print(f"server / generate: TTFT {ratio['ttft_ms']:.3f}x, tokens/s "
        f"{ratio['tokens_per_s']:.3f}x (medians of the pairs' ratios: "
        f"{paired['ttft_ms']:.3f}x, {paired['tokens_per_s']:.3f}x); wrote {FLAGS.out}")
