"""Layers as one scan over stacked weights, read in place by the `_at` kernels, against
the same layers unrolled over per-layer arrays (issue 45, item 3).

  python -m launch.bench_layer_scan --out=docs/lab/runs/2026-12-05-engine4-scan/layer_scan.json

Not part of the tests. A chain over --layers decoder-layer projections of the
Qwen3-30B-A3B width (bf16, one token): per layer q/k/v (`cpu_matmul.linears`, one call)
and o_proj, then the residual. Three programs of the same arithmetic:

  unrolled     one array per layer and weight, the layers unrolled (the engine before);
  scan_view    one stacked [L, ...] array per weight, a `lax.scan` whose body reads
               layer i through `layer_view.at` (the `_at` kernels: in place);
  scan_slice   the same scan with plain slices (XLA CPU copies each layer's weights
               before the kernel reads them: what the scan cost without the `_at` kernels).

--rounds alternating rounds, each the median of --iters calls; reported: medians over
rounds, their ratios to `unrolled`, and each program's compile time (lower + compile,
MOEJAX_COMPILE_CACHE=0 to time a cold compile) at --layers and at --layers_deep.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel, cpu_matmul, layer_view

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "layer_scan.json", "JSON results file.")
flags.DEFINE_integer("layers", 8, "Layers of the timed chain.")
flags.DEFINE_integer("layers_deep", 24, "Layers of the second compile (depth independence).")
flags.DEFINE_integer("hidden", 2048, "Hidden size D.")
flags.DEFINE_integer("q_width", 4096, "Query heads x head dim.")
flags.DEFINE_integer("kv_width", 512, "KV heads x head dim.")
flags.DEFINE_integer("iters", 20, "Timed calls per measurement.")
flags.DEFINE_integer("rounds", 5, "Alternating rounds.")

_NAMES = ("q", "k", "v", "o")


def _layer(x, w):
  q, k, v = cpu_matmul.linears(x, [w["q"], w["k"], w["v"]])
  y = cpu_matmul.linear(q, w["o"])
  return x + y + 1e-3 * (jnp.sum(k) + jnp.sum(v)).astype(x.dtype)


def unrolled(x, ws: list):
  for w in ws:
    x = _layer(x, w)
  return x


def scan(x, stacked: dict, view: bool):
  n = stacked["q"].shape[0]

  def body(x, i):
    with layer_view.tracing():
      get = layer_view.at if view else (lambda s, i: s[i])
      return _layer(x, {k: get(s, i) for k, s in stacked.items()}), None
  return jax.lax.scan(body, x, jnp.arange(n, dtype=jnp.int32))[0]


def _weights(n: int, rng):
  d, qw, kw = FLAGS.hidden, FLAGS.q_width, FLAGS.kv_width
  shapes = {"q": (qw, d), "k": (kw, d), "v": (kw, d), "o": (d, qw)}
  return {k: jnp.asarray(rng.normal(size=(n,) + s).astype(np.float32) * 0.01, jnp.bfloat16)
          for k, s in shapes.items()}


def _programs(n: int, rng):
  stacked = _weights(n, rng)
  per_layer = [{k: jnp.array(s[i]) for k, s in stacked.items()} for i in range(n)]
  x = jnp.asarray(rng.normal(size=(1, FLAGS.hidden)), jnp.bfloat16)
  fns = {"unrolled": (jax.jit(unrolled), per_layer),
         "scan_view": (jax.jit(lambda x, s: scan(x, s, True)), stacked),
         "scan_slice": (jax.jit(lambda x, s: scan(x, s, False)), stacked)}
  out, compile_s = {}, {}
  for name, (fn, w) in fns.items():
    t0 = time.perf_counter()
    out[name] = (fn.lower(x, w).compile(), w)
    compile_s[name] = time.perf_counter() - t0
  return x, out, compile_s


def _time(fn, x, w) -> float:
  jax.block_until_ready(fn(x, w))
  ts = []
  for _ in range(FLAGS.iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x, w))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def main(argv):
  del argv
  if not cpu_kernel.available():
    raise SystemExit("bench_layer_scan: the CPU kernels are not available "
                     "(MOEJAX_CPU_KERNEL, a C++ compiler): nothing to compare")
  rng = np.random.default_rng(0)
  _, _, deep_compile = _programs(FLAGS.layers_deep, rng)   # compile times only, then freed
  x, progs, compile_s = _programs(FLAGS.layers, rng)
  ref = np.asarray(progs["unrolled"][0](x, progs["unrolled"][1]), np.float32)
  same = {n: bool(np.array_equal(np.asarray(f(x, w), np.float32), ref))
          for n, (f, w) in progs.items()}
  rounds = {n: [] for n in progs}
  with cpu_kernel.decoding():
    for _ in range(FLAGS.rounds):
      for n, (f, w) in progs.items():
        rounds[n].append(_time(f, x, w))
  med = {n: statistics.median(v) for n, v in rounds.items()}
  res = {"layers": FLAGS.layers, "layers_deep": FLAGS.layers_deep, "hidden": FLAGS.hidden,
         "q_width": FLAGS.q_width, "kv_width": FLAGS.kv_width, "iters": FLAGS.iters,
         "load_avg": os.getloadavg(), "median_ms": med, "rounds_ms": rounds,
         "ratio_to_unrolled": {n: med[n] / med["unrolled"] for n in med},
         "same_bits_as_unrolled": same,
         "compile_s": {FLAGS.layers: compile_s, FLAGS.layers_deep: deep_compile}}
  for n in progs:
    print(f"{n:11s} {med[n]:8.2f} ms  x{res['ratio_to_unrolled'][n]:.3f}  same bits: {same[n]}  "
          f"compile {compile_s[n]:.2f} s ({FLAGS.layers} layers), "
          f"{deep_compile[n]:.2f} s ({FLAGS.layers_deep})")
  print(f"load average {res['load_avg']}")
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
