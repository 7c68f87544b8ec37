"""Decode tok/s of the Sampler (128 greedy tokens after 64, medians of N rounds) for one
model, from the checkout at $ROOT: `ROOT=<checkout> python ab.py <label> <model> [rounds]`;
label min0 sends every f32 projection to the kernel. Run two checkouts alternately for an
A/B (docs/lab/notes/cpu_speed.md, "One row at a time")."""
import sys, time, statistics, numpy as np, jax
import os
sys.path.insert(0, os.environ.get("ROOT", "."))
from moejax.kernels import cpu_kernel
mode, name = sys.argv[1], sys.argv[2]
if mode == "min0":
  cpu_kernel.LINEAR_MIN_F32_BYTES = 0
from benchmarks import models as bench_models
from moejax.model.sampler import Sampler, SamplingParams
cfg, params, store, _, _ = bench_models.load(name, os.path.join(os.environ.get("ROOT", "."), "ckpts", "demo"))
kind, dtype = bench_models.split_name(name)
s = Sampler(cfg, params, store.to_device(), max_len=256, dtype=dtype)
rng = np.random.default_rng(0); prompt = rng.integers(0, cfg.vocab_size, 64).astype(np.int32)
sp, key = SamplingParams(), jax.random.PRNGKey(0)
def once(n=128):
  logits, cache = s.prefill(prompt[None]); tok = logits.argmax(-1).astype(np.int32)
  tok = jax.numpy.asarray(tok); tok.block_until_ready()
  t = time.perf_counter()
  for i in range(n):
    tok, _, cache = s.decode_step(cache, tok, 64 + i, sp, key)
  tok.block_until_ready(); return n / (time.perf_counter() - t)
once(); r = [once() for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5)]
print(mode, name, "median %.1f" % statistics.median(r), " ".join("%.0f" % v for v in r))
