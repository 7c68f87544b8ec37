"""Sampler prefill on wide_bf16 (4 layers, mmap store): prompts of 300 (bucket 512) and 512 tokens, best of
3 each, and the first logits.  PYTHONPATH=. python docs/lab/runs/2026-12-06-padding/prefill_wide.py"""

import time, sys, numpy as np, jax, jax.numpy as jnp
from benchmarks import models as bench_models
from moejax.model.sampler import Sampler
from moejax.kernels import cpu_kernel
cfg, params, store, hf_dir, tok_path = bench_models.load("wide_bf16", None)
s = Sampler(cfg, params, store.device_experts(), max_len=600, dtype=jnp.bfloat16)
for n in (300, 512):
  p = np.arange(1, n + 1, dtype=np.int32)[None]
  lg, c = s.prefill(p); jax.block_until_ready(lg)
  ts = []
  for _ in range(3):
    t = time.perf_counter(); lg, c = s.prefill(p); jax.block_until_ready(lg); ts.append(time.perf_counter() - t)
  print("prefill %d tokens: best %.2f s (%s), %.0f tok/s; logits[:3] %s" % (n, min(ts), " ".join("%.2f" % x for x in ts), n / min(ts), np.asarray(lg)[0, :3]))
