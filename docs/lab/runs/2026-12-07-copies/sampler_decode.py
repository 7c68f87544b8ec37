"""The Sampler's decode alone on a benchmark model: a 16-token prompt, then N teacher-forced
decode steps inside cpu_kernel.decoding(), three repetitions (the first warms up).

    PYTHONPATH=. python docs/lab/runs/2026-12-07-copies/sampler_decode.py wide_q8_0 256
"""
import sys, time, os
import jax, numpy as np
from benchmarks import models as bench_models
from moejax.kernels import cpu_kernel
from moejax.model.sampler import Sampler, SamplingParams
name = sys.argv[1]; n = int(sys.argv[2])
cfg, params, store, hf_dir, tok = bench_models.load(name, bench_models.DEMO_DIR)
s = Sampler(cfg, params, store.device_experts(), max_len=600, dtype=sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
rng = np.random.default_rng(0)
prompt = rng.integers(0, 8000, 16).astype(np.int32)
forced = rng.integers(0, 8000, n).astype(np.int32)
for rep in range(3):
  logits, cache = s.prefill(prompt[None]); logits.block_until_ready()
  key, sp = jax.random.PRNGKey(0), SamplingParams()
  with cpu_kernel.decoding():
    t0 = time.perf_counter()
    for i, tok in enumerate(forced[:, None]):
      _, lg, cache = s.decode_step(cache, tok, 16 + i, sp, key)
    lg.block_until_ready()
  dt = time.perf_counter() - t0
  print(f"{name} rep {rep}: {n / dt:.1f} tok/s ({1e3 * dt / n:.2f} ms/token)", flush=True)
