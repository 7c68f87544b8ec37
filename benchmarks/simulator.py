"""Simulator throughput: (token, layer) decisions per second.

  python -m launch.bench_simulator --out=bench_simulator.json

Replays a synthetic router trace shaped like Qwen3-30B-A3B (48 MoE layers, 128 experts,
top-8; moejax.research.synthetic with default generator parameters) under one policy,
after a compile run, and reports `decisions_per_s` = tokens x layers / seconds (best of
--repeats). With --sweep=P it also replays P variants of the policy (tau spread over
[0.05, 0.5]: one static group, one vmapped scan) on --traces=R traces at once and
reports their aggregate `sweep_decisions_per_s` (P x R x tokens x layers / seconds). It
starts one CPU device per core (XLA_FLAGS; a value given in XLA_FLAGS wins): the
simulator runs a slice of the layers on each. The machine's load average is recorded
next to the figures (a shared machine's numbers move with it), and so is
`decisions_per_cpu_s` (per second of this process's CPU time), which a loaded machine
moves much less.
"""

from __future__ import annotations

import json
import os
import sys
import time

# one CPU device per core before JAX starts: the simulator splits the layers between them
# and runs the slices concurrently (`simulator._layer_slices`)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={os.cpu_count()}")

from absl import flags
import jax
import numpy as np

from moejax.research import simulator, synthetic
from moejax.cache import policy as policy_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_simulator.json", "JSON results file.")
flags.DEFINE_integer("tokens", 4096, "Trace tokens.")
flags.DEFINE_integer("layers", 48, "MoE layers.")
flags.DEFINE_integer("experts", 128, "Experts per layer.")
flags.DEFINE_integer("top_k", 8, "Experts per token.")
flags.DEFINE_string("policy", "quality", "Policy (preset or miss rule).")
flags.DEFINE_float("cache_fraction", 0.25, "Experts per layer resident.")
flags.DEFINE_integer("sweep", 0, "Also time this many tau variants in one vmapped scan.")
flags.DEFINE_integer("traces", 1, "Sweep over this many traces (seeds) at once: policies x "
                     "traces, the traces' layers side by side (layers are independent).")
flags.DEFINE_integer("repeats", 2, "Timed runs (best is reported).")
flags.DEFINE_integer("chunk", 4096, "Tokens per jitted scan call.")


def timed(cfg, logits, pols) -> tuple[float, float]:
  """Best wall seconds and best CPU seconds (this process, all threads) of the runs:
  on a shared machine the CPU time is the steadier measure of the work done."""
  best, best_cpu = np.inf, np.inf
  for _ in range(FLAGS.repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    simulator.simulate(cfg, logits, pols, cache_fraction=FLAGS.cache_fraction,
                       chunk=FLAGS.chunk)
    best = min(best, time.perf_counter() - t0)
    best_cpu = min(best_cpu, time.process_time() - c0)
  return best, best_cpu


def main(_):
  cfg = synthetic.shape_config(FLAGS.experts, FLAGS.top_k, FLAGS.layers)
  rng = np.random.default_rng(0)
  pop = np.full((1, FLAGS.experts), 1.0 / FLAGS.experts)
  bias = synthetic.popularity_bias(pop, FLAGS.experts, FLAGS.layers, rng)
  logits = synthetic.generate(FLAGS.tokens, bias, synthetic.GenParams(), seed=1)
  pol = policy_lib.make_policy(FLAGS.policy)
  t0 = time.perf_counter()
  simulator.simulate(cfg, logits[:FLAGS.chunk], [pol], cache_fraction=FLAGS.cache_fraction,
                     chunk=FLAGS.chunk)
  compile_s = time.perf_counter() - t0
  secs, cpu = timed(cfg, logits, [pol])
  n = FLAGS.tokens * FLAGS.layers
  res = dict(decisions_per_s=n / secs, seconds=secs, decisions_per_cpu_s=n / cpu,
             cpu_seconds=cpu, tokens=FLAGS.tokens, layers=FLAGS.layers,
             experts=FLAGS.experts, top_k=FLAGS.top_k, policy=pol.describe(),
             cache_fraction=FLAGS.cache_fraction, first_call_s=compile_s,
             load_average=os.getloadavg(), cpu_count=os.cpu_count(), target=5e6,
             devices=len(jax.devices()))
  print(f"[bench_simulator] one policy: {n / secs:,.0f} decisions/s ({FLAGS.tokens} tokens x "
        f"{FLAGS.layers} layers in {secs:.2f} s, {n / cpu:,.0f} per CPU second; first call incl. "
        f"compile {compile_s:.1f} s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", file=sys.stderr)
  if FLAGS.sweep:
    pols = [policy_lib.make_policy(FLAGS.policy, tau=float(t))
            for t in np.linspace(0.05, 0.5, FLAGS.sweep)]
    # R traces (seeds 1..R) side by side on the layer axis: one replay of R x L layers
    scfg = synthetic.shape_config(FLAGS.experts, FLAGS.top_k, FLAGS.layers * FLAGS.traces)
    slogits = np.concatenate([logits] + [
        synthetic.generate(FLAGS.tokens, bias, synthetic.GenParams(), seed=1 + r)
        for r in range(1, FLAGS.traces)], axis=1)
    simulator.simulate(scfg, slogits[:FLAGS.chunk], pols, cache_fraction=FLAGS.cache_fraction,
                       chunk=FLAGS.chunk)
    secs, cpu = timed(scfg, slogits, pols)
    m = FLAGS.sweep * FLAGS.traces * n
    res.update(sweep_policies=FLAGS.sweep, sweep_traces=FLAGS.traces, sweep_seconds=secs,
               sweep_cpu_seconds=cpu, sweep_decisions_per_s=m / secs,
               sweep_decisions_per_cpu_s=m / cpu)
    print(f"[bench_simulator] sweep of {FLAGS.sweep} variants x {FLAGS.traces} trace(s): "
          f"{m / secs:,.0f} decisions/s in total ({secs:.2f} s, {m / cpu:,.0f} per CPU "
          f"second)", file=sys.stderr)
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  print(json.dumps({k: res[k] for k in ("decisions_per_s", "decisions_per_cpu_s", "seconds",
                                        "load_average")}))
