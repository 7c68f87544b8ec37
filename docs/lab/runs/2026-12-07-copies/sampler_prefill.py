"""The Sampler's prefill alone on a benchmark model: one N-token random prompt, compiled
and run once, then REPS timed calls (tok/s each).

    PYTHONPATH=. python docs/lab/runs/2026-12-07-copies/sampler_prefill.py wide_q4_k_m 512 5
"""
import sys, time, os
import jax, numpy as np
from benchmarks import models as bench_models
from moejax.model.sampler import Sampler
name = sys.argv[1]; n = int(sys.argv[2])
cfg, params, store, hf_dir, tok = bench_models.load(name, bench_models.DEMO_DIR)
s = Sampler(cfg, params, store.device_experts(), max_len=n + 8, dtype="bfloat16")
rng = np.random.default_rng(0)
prompt = rng.integers(0, 8000, n).astype(np.int32)
s.prefill(prompt[None])[0].block_until_ready()
for rep in range(int(sys.argv[3])):
  t0 = time.perf_counter()
  s.prefill(prompt[None])[0].block_until_ready()
  dt = time.perf_counter() - t0
  print(f"{name} prefill {n}: {n / dt:.1f} tok/s", flush=True)
