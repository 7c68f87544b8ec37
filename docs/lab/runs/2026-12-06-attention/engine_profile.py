"""Profile the offload engine's decode (wide_bf16 4L, mmap store, native link, 25%): median ms a
token, then time per HLO op over 16 profiled tokens.  PYTHONPATH=. python engine_profile.py baseline"""
import time, sys, os, contextlib, numpy as np, jax
import jax.numpy as jnp
from benchmarks import models as bench_models
from moejax.io.loader import load_model
from moejax.io.store import make_store
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.kernels import cpu_kernel
from leaf_ops import leaf_ops
pol = sys.argv[1] if len(sys.argv) > 1 else "baseline"
d = bench_models.wide_dir(4, bench_models.WIDE_DIR)
cfg, params, store = load_model(d, dtype=jnp.bfloat16, mmap=True)
store = make_store(store, "mmap")
rng = np.random.default_rng(0)
eng = OffloadEngine(cfg, params, store, EngineConfig.make(pol, cache_fraction=0.25, link="native", max_len=256, dtype=jnp.bfloat16))
eng.warmup()
eng.prefill([int(t) for t in rng.integers(1, 8000, 16)])
tok = 5
with cpu_kernel.decoding():
  for _ in range(8): lg = eng.decode_step(tok); tok = int(np.argmax(lg))
  ts = []
  for _ in range(24):
    t = time.perf_counter(); lg = eng.decode_step(tok); tok = int(np.argmax(lg)); ts.append(time.perf_counter() - t)
  print(pol, "median ms/token %.2f" % (1e3 * np.median(ts)))
  pd = "/tmp/prof_eng"; os.system("rm -rf " + pd)
  jax.profiler.start_trace(pd)
  for _ in range(16): lg = eng.decode_step(tok); tok = int(np.argmax(lg))
  jax.profiler.stop_trace()
tot, cnt = leaf_ops(pd)
print("leaf total %.0f us/token" % (sum(tot.values()) / 16))
for k, t in tot.most_common(15): print("%9.1f us/token %5d  %s" % (t / 16, cnt[k] // 16, k))
eng.close()
