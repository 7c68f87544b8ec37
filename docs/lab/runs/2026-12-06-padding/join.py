"""A join: the batch's exact prompt pass of a 9-token prompt (bucket 16) into a row, demo model,
quality 25%, native link, batch of 8, --max_len 2048: median and best of 30.  Run from a checkout root."""
import time, sys, numpy as np, jax
from moejax.io.loader import load_model
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.kernels import cpu_kernel
cfg, params, store = load_model("ckpts/demo")
rng = np.random.default_rng(0)
eng = OffloadEngine(cfg, params, store, EngineConfig.make("quality", cache_fraction=0.25, max_len=2048, link="native"))
b = eng.batched(8)
b.warmup([16])
for r in range(8): b.prompt([int(t) for t in rng.integers(1, 8000, 12)], row=r)
ts=[]
for i in range(30):
  ids=[int(t) for t in rng.integers(1, 8000, 9)]
  t=time.perf_counter(); b.prompt(ids, row=i%8); ts.append(time.perf_counter()-t)
print("join ms median %.2f min %.2f" % (1e3*np.median(ts), 1e3*min(ts)))
