"""Microbenchmark of the quantized CPU kernels (issue 61, Engine V): one LinearQ call at the
LM-head shape (151936 x 2048) and one ExpertFfnQ call at the expert shapes (gate/up
768 x 2048, down 2048 x 768, 8 of 128 experts a token) for Q8_0, Q4_0, Q4_K and Q6_K,
through the public wrappers (moejax.kernels.cpu_quant), 1 token (decode) and 128 / 512
tokens (prompt). Reports the weight GB/s (bytes of the blocks the call reads / its time)
and GFLOP/s (2 * tokens * the multiply-adds it does), from the wall time, and the process
CPU time of a call (on the shared VM other jobs stretch the wall time; the CPU time, which
counts both kernel threads, moves less).

    PYTHONPATH=. python docs/lab/runs/2026-12-07-kernels/kernel_bench.py \
        [--reps=9] [--rounds=3] [--tokens=1,128,512] [--formats=q8_0,q4_0,q4_k,q6_k] \
        [--shapes=head,experts] [--out=FILE.json]

Formats are interleaved within a round (A B C D, A B C D ...), each timing is the median
of `reps` calls, the figure reported the median over rounds. The kernels use their pool
(XLA's CPU intra-op threads, 2 on the lab VM). Weights are random valid blocks (the
kernels' time does not depend on the codes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel, cpu_quant

HEAD = (151936, 2048)
D, INTER, EXPERTS, TOPK = 2048, 768, 128, 8


def random_blocks(rng, qtype, rows, cols):
  """Valid blocks [rows, cols / bs * size]: random codes, small positive f16 scales."""
  _, bs, size = cpu_quant.QTYPES[qtype]
  n = rows * cols // bs
  raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
  half = np.full((n, 1), 1e-3, np.float16).view(np.uint8)
  at = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[qtype]
  for a in at:
    raw[:, a:a + 2] = half
  return raw.reshape(rows, cols // bs * size)


def _median_time(fn, args, reps):
  """(median wall seconds, median process CPU seconds) of a call."""
  jax.block_until_ready(fn(*args))   # compile, warm
  ts, cs = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
    cs.append(time.process_time() - c0)
  return statistics.median(ts), statistics.median(cs)


def head_case(rng, qtype, n):
  """(fn, args, weight bytes, flops) of the LM head's linear for n tokens."""
  w = jnp.asarray(random_blocks(rng, qtype, *HEAD))
  x = jnp.asarray(rng.standard_normal((n, HEAD[1]), np.float32))
  fn = jax.jit(lambda x, w: cpu_quant.linear_q(x, w, qtype))
  return fn, (x, w), w.size, 2.0 * n * HEAD[0] * HEAD[1]


def expert_case(rng, qtype, n):
  """(fn, args, weight bytes read, flops) of the routed FFN for n tokens, top-8 of 128
  experts at random (a prompt touches about every expert, decode 8)."""
  gu = jnp.asarray(random_blocks(rng, qtype, EXPERTS * 2 * INTER, D).reshape(
      EXPERTS, 2 * INTER, -1))
  dn = jnp.asarray(random_blocks(rng, qtype, EXPERTS * D, INTER).reshape(EXPERTS, D, -1))
  x = jnp.asarray(rng.standard_normal((n, D), np.float32))
  ids = np.stack([rng.choice(EXPERTS, TOPK, replace=False) for _ in range(n)]).astype(np.int32)
  gates = jnp.full((n, TOPK), 1.0 / TOPK, jnp.float32)
  fn = jax.jit(lambda x, i, g, a, b: cpu_quant.expert_ffn_q(
      x, i, g, {"gate_up": a, "down": b}, {"gate_up": qtype, "down": qtype}))
  used = len(np.unique(ids))
  nbytes = used * (gu.size + dn.size) // EXPERTS
  return fn, (x, jnp.asarray(ids), gates, gu, dn), nbytes, 2.0 * n * TOPK * 3 * INTER * D


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--tokens", default="1,128,512")
  ap.add_argument("--formats", default="q8_0,q4_0,q4_k,q6_k")
  ap.add_argument("--shapes", default="head,experts")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  if not cpu_kernel.available():
    sys.exit("kernel_bench: the C++ kernels are not built here (no compiler?)")
  fmts = args.formats.split(",")
  rng = np.random.default_rng(0)
  rows = []
  for shape in args.shapes.split(","):
    make = {"head": head_case, "experts": expert_case}[shape]
    for n in (int(t) for t in args.tokens.split(",")):
      reps = args.reps if n == 1 else max(3, args.reps // 3)
      times = {q: [] for q in fmts}
      cpus = {q: [] for q in fmts}
      info = {}
      for _ in range(args.rounds):
        for q in fmts:   # interleaved: one case alive at a time (the head is 0.2-0.3 GB)
          fn, fargs, nbytes, flops = make(rng, q, n)
          wall, cpu = _median_time(fn, fargs, reps)
          times[q].append(wall)
          cpus[q].append(cpu)
          info[q] = (nbytes, flops)
          del fn, fargs
      for q in fmts:
        t = statistics.median(times[q])
        nbytes, flops = info[q]
        row = {"shape": shape, "format": q, "tokens": n, "ms": round(t * 1e3, 3),
               "cpu_ms": round(statistics.median(cpus[q]) * 1e3, 3),
               "weight_gb_s": round(nbytes / t / 1e9, 2), "gflop_s": round(flops / t / 1e9, 1),
               "ms_rounds": [round(x * 1e3, 3) for x in times[q]]}
        rows.append(row)
        print(f"{shape:8s} {q:5s} n={n:4d}  {row['ms']:9.3f} ms  {row['weight_gb_s']:6.2f} GB/s"
              f"  {row['gflop_s']:7.1f} GFLOP/s  cpu {row['cpu_ms']:9.3f} ms", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"isa": cpu_quant.isa(), "load": os.getloadavg(), "argv": sys.argv[1:],
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
