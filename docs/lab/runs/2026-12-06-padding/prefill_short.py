"""Sampler prefill on wide_bf16 of 20, 32, 64 and 100-token prompts (buckets 32, 32, 64, 128), best of 3.
PYTHONPATH=. python docs/lab/runs/2026-12-06-padding/prefill_short.py"""
import time, sys, numpy as np, jax, jax.numpy as jnp
from benchmarks import models as bench_models
from moejax.model.sampler import Sampler
cfg, params, store, hf_dir, tok_path = bench_models.load("wide_bf16", None)
s = Sampler(cfg, params, store.device_experts(), max_len=600, dtype=jnp.bfloat16)
for n in (20, 32, 64, 100):
  p = np.arange(1, n + 1, dtype=np.int32)[None]
  lg, c = s.prefill(p); jax.block_until_ready(lg)
  ts = []
  for _ in range(3):
    t = time.perf_counter(); lg, c = s.prefill(p); jax.block_until_ready(lg); ts.append(time.perf_counter() - t)
  print("prefill %d tokens: best %.3f s, %.0f tok/s; logits[:3] %s" % (n, min(ts), n / min(ts), np.asarray(lg)[0, :3]))
