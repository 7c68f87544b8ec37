"""A HOST miss's expert compute: moejax's beside llama.cpp's (ggml) on the same cores.

  python -m launch.bench_host --out=docs/lab/runs/2026-12-04-host/bench_host.json

Not part of the tests. One SwiGLU expert of the Qwen3-30B-A3B shape (hidden 2048,
intermediate 768, bf16 weights, one token) and K of them (--ks, default 1 and 8), a
store of --experts experts (150 MB at 16: above the last-level cache, so every call
reads its weights from memory, as a decode step does); call i uses experts
(i*K .. i*K+K-1) mod E on both sides.

  moejax         `sources.host_experts`: the engine's HOST branch, jitted on the CPU
                 device, its store as the engine holds it (bf16 as uint16 bits), the
                 token in bf16; on the CPU backend the in-place kernel (`cpu_host`).
                 Timed by moejax.research.host_time, as `moejax-host-ms` times it.
  moejax_slices  the same with in_place=False: each expert sliced out of the store,
                 then the routed-expert kernel (the HOST branch before the kernel).
  llama.cpp      benchmarks/ggml_expert_timer.cpp against the ggml of bench_peers' llama.cpp
                 build (K = 1: mul_mat gate/up, swiglu, mul_mat down; K > 1: mul_mat_id as
                 llama.cpp's MoE FFN), --threads threads on one threadpool; llama.cpp_1t:
                 one thread. As in bench_peers, llama.cpp's figure is the faster of the
                 two: its threads spin at barriers, so on a machine busier than its cores
                 the --threads run collapses (a graph of K experts has ~12 barriers).

--rounds alternating rounds (moejax, llama.cpp, moejax_slices per K); each reports the
median of --iters calls. Reported: the median over rounds, the ratio moejax / llama.cpp
of the medians and the median of the per-round ratios, and whether that is within
--target (1.5x, issue 37 item 4). `host_ms` (moejax, K = 1) is what `generate
--policy=cost --host_ms=FILE` reads; `moejax-host-ms` (moejax/cli/prepare/host_ms.py)
measures it alone, without llama.cpp, in an installed moejax.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from absl import flags
import jax.numpy as jnp
import numpy as np

from benchmarks import llama_cpp
from moejax.kernels import cpu_kernel
from moejax.research.host_time import host_fn, make_store, qwen3_like, time_calls

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_host.json", "JSON results file.")
flags.DEFINE_integer("hidden", 2048, "Hidden size D.")
flags.DEFINE_integer("inter", 768, "Expert intermediate size I.")
flags.DEFINE_integer("experts", 16, "Experts in the store (rotated through).")
flags.DEFINE_list("ks", ["1", "8"], "Experts per call.")
flags.DEFINE_integer("iters", 50, "Timed calls per measurement.")
flags.DEFINE_integer("rounds", 5, "Alternating rounds.")
flags.DEFINE_integer("threads", 2, "llama.cpp's threads (moejax uses XLA's CPU pool: the cores).")
flags.DEFINE_float("target", 1.5, "Largest moejax / llama.cpp ratio of the target.")
flags.DEFINE_bool("slices", True, "Also time moejax_slices (the path before the kernel).")
flags.DEFINE_string("llama_cache", llama_cpp.DEFAULT_CACHE, "Where llama.cpp (ggml) is built.")


def summarize(rounds: list, engines: list, target: float) -> dict:
  out = {}
  for k in sorted({r["k"] for r in rounds}):
    rs = [r for r in rounds if r["k"] == k]
    for r in rs:                  # llama.cpp: the faster of --threads and one thread
      r["llama.cpp"] = min(r["llama.cpp_nt"], r["llama.cpp_1t"])
    med = {e: statistics.median(r[e] for r in rs) for e in engines + ["llama.cpp"]
           if e in rs[0]}
    ratios = [r["moejax"] / r["llama.cpp"] for r in rs]
    out[str(k)] = {
        **{f"{e}_ms": 1e3 * v for e, v in med.items()},
        "ratio_of_medians": med["moejax"] / med["llama.cpp"],
        "median_of_round_ratios": statistics.median(ratios),
        "round_ratios": ratios,
        "target_met": med["moejax"] / med["llama.cpp"] <= target,
    }
    if "moejax_slices" in med:
      out[str(k)]["slices_over_moejax"] = med["moejax_slices"] / med["moejax"]
  return out


def main(argv):
  del argv
  d, inter, e = FLAGS.hidden, FLAGS.inter, FLAGS.experts
  ks = [int(k) for k in FLAGS.ks]
  if not cpu_kernel.available():
    print("[bench_host] the CPU kernels are not available here: moejax runs XLA's path",
          file=sys.stderr)
  try:
    timer = llama_cpp.build_ggml(FLAGS.llama_cache)
  except llama_cpp.Unavailable as err:
    sys.exit(f"[bench_host] llama.cpp (ggml) cannot be built here: {err}")
  store = make_store(d, inter, e)
  x = jnp.asarray(np.random.default_rng(1).standard_normal(d), jnp.bfloat16)
  fns = {k: {"moejax": host_fn(qwen3_like(d, inter, e, k), True),
             "moejax_slices": host_fn(qwen3_like(d, inter, e, k), False)} for k in ks}
  engines = ["moejax", "llama.cpp_nt", "llama.cpp_1t"] + (
      ["moejax_slices"] if FLAGS.slices else [])
  load0 = os.getloadavg()
  rounds = []
  for r in range(FLAGS.rounds):
    for k in ks:
      row = {"round": r, "k": k}
      for eng in engines:
        if eng.startswith("llama.cpp"):
          threads = FLAGS.threads if eng == "llama.cpp_nt" else 1
          res = llama_cpp.time_experts(timer, d, inter, e, k, threads, FLAGS.iters)
          row[eng], row["ggml_avx512_bf16"] = res["median_s"], res["ggml_cpu_has_avx512_bf16"]
        else:
          iters = FLAGS.iters if eng == "moejax" else max(5, FLAGS.iters // (2 * k))
          row[eng] = time_calls(fns[k][eng], store, x, k, e, iters)
      rounds.append(row)
      print(f"round {r} k={k}: " + ", ".join(f"{eng} {1e3 * row[eng]:.3f} ms" for eng in engines),
            file=sys.stderr)
  summary = summarize(rounds, engines, FLAGS.target)
  res = {
      "shape": {"hidden": d, "inter": inter, "experts_in_store": e, "dtype": "bf16",
                "tokens": 1, "store_mb": 3 * e * d * inter * 2 / 1e6},
      "threads": FLAGS.threads, "iters": FLAGS.iters, "rounds": FLAGS.rounds,
      "target_ratio": FLAGS.target, "cpu_kernel": cpu_kernel.available(),
      "cpu_count": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
      "command": " ".join(["python -m launch.bench_host"] + sys.argv[1:]),
      "summary": summary, "rounds_raw": rounds,
      "host_ms": summary[str(ks[0])]["moejax_ms"] / ks[0] if ks else None,
  }
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"{'K':>3} {'moejax ms':>10} {'llama.cpp ms':>13} {'ratio':>6} {'round ratios':>14} "
        f"{'slices ms':>10} {'target':>7}")
  for k, s in summary.items():
    rr = sorted(s["round_ratios"])
    print(f"{k:>3} {s['moejax_ms']:>10.3f} {s['llama.cpp_ms']:>13.3f} "
          f"{s['ratio_of_medians']:>6.2f} {rr[0]:>6.2f}-{rr[-1]:<7.2f} "
          f"{s.get('moejax_slices_ms', float('nan')):>10.3f} "
          f"{'met' if s['target_met'] else 'MISSED':>7}")
  print(f"[bench_host] wrote {FLAGS.out}; load average {load0[0]:.2f} -> "
        f"{os.getloadavg()[0]:.2f}", file=sys.stderr)

