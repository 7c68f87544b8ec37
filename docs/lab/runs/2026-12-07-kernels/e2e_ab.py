"""The Sampler's prefill and decode on one wide GGUF model (benchmarks.models.load), for an
A/B of two kernel builds: run it once per tree, alternating (the moejax package on
PYTHONPATH picks the build). Prints and writes the wall and process CPU seconds of a
512-token prefill (3 calls after a warm one) and of 32 teacher-forced decode steps after a
64-token prompt (inside cpu_kernel.decoding(), as bench_peers times them; 3 rounds).

    PYTHONPATH=<tree>:. python docs/lab/runs/2026-12-07-kernels/e2e_ab.py wide_q4_k_m OUT.json
"""

import json
import os
import statistics
import sys
import time

import jax
import numpy as np

from benchmarks import models as bench_models
from moejax.kernels import cpu_kernel
from moejax.model.sampler import Sampler, SamplingParams


def timed(fn):
  t, c = time.perf_counter(), time.process_time()
  fn()
  return time.perf_counter() - t, time.process_time() - c


def main(name, out):
  cfg, params, store, _, _ = bench_models.load(name)
  _, dtype = bench_models.split_name(name)
  s = Sampler(cfg, params, store.device_experts(), max_len=600, dtype=dtype)
  ids = np.random.default_rng(0).integers(0, 8192, 600).astype(np.int32)
  pre = lambda: s.prefill(ids[None, :512])[0].block_until_ready()
  pre()
  prefill = [timed(pre) for _ in range(3)]
  key, sp = jax.random.PRNGKey(0), SamplingParams()
  decode = []
  for _ in range(4):
    logits, cache = s.prefill(ids[None, :64])
    logits.block_until_ready()

    def run():
      nonlocal cache
      for i in range(32):
        _, lg, cache = s.decode_step(cache, ids[64 + i:65 + i], 64 + i, sp, key)
      lg.block_until_ready()
    with cpu_kernel.decoding():
      decode.append(timed(run))
  decode = decode[1:]   # the first compiles
  res = {"model": name, "load": os.getloadavg(),
         "prefill_512_wall_s": [p[0] for p in prefill], "prefill_512_cpu_s": [p[1] for p in prefill],
         "decode_32_wall_s": [d[0] for d in decode], "decode_32_cpu_s": [d[1] for d in decode]}
  print(f"{name}: prefill 512 tok/s wall {512 / statistics.median(res['prefill_512_wall_s']):.1f}"
        f" cpu-s {statistics.median(res['prefill_512_cpu_s']):.2f}; decode tok/s wall "
        f"{32 / statistics.median(res['decode_32_wall_s']):.1f} cpu-s "
        f"{statistics.median(res['decode_32_cpu_s']):.2f}; load {res['load'][0]:.1f}", flush=True)
  with open(out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
