"""One-off record: the cost of copying K experts into slot buffers inside a program, from the
mapped store (a dynamic slice of the mapped file, page cache warm) against through the host
staging tier's callback (rows staged), at Qwen3-30B-A3B's width (wide_bf16_4L, layer 0).
Alternating, ROUNDS rounds of REPS calls each; prints JSON.

  PYTHONPATH=. python docs/lab/runs/2026-12-05-host-cache/copy_cost.py
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import staging
from moejax.io.loader import load_model
from moejax.io import placement
from moejax.offload import sources

K, SLOTS, ROUNDS, REPS = 8, 33, 5, 10
_, _, store = load_model(os.path.expanduser("~/.cache/moejax/models/wide_bf16_4L"),
                         dtype=jnp.bfloat16, mmap=True, progress=False)
layer = store.moe_layers[0]
host, _ = placement.program_store(store, jax.devices()[0])
cache = staging.StagingCache(store, 64 * store.expert_nbytes())
ids = np.arange(K, dtype=np.int32) * 5
for e in ids:                                   # staged (and the file's pages cached)
  cache.read(layer, e)
  cache.read(layer, e)
bufs = {k: jnp.zeros((SLOTS,) + v.shape[1:], jnp.bfloat16) for k, v in host[layer].items()}
slots = np.arange(K, dtype=np.int32)
fn = jax.jit(lambda b, st: sources.copy_rows(b, st, ids, slots, False), donate_argnums=0)
srcs = {"mapped": host[layer], "staged": staging.Staged(cache, layer)}
times = {k: [] for k in srcs}
for name, src in srcs.items():                  # compile both
  bufs = fn(bufs, src)
jax.block_until_ready(bufs)
for _ in range(ROUNDS):
  for name, src in srcs.items():
    t0 = time.perf_counter()
    for _ in range(REPS):
      bufs = fn(bufs, src)
    jax.block_until_ready(bufs)
    times[name].append(1e3 * (time.perf_counter() - t0) / REPS)
print(json.dumps({"experts_per_call": K, "expert_mb": store.expert_nbytes() / 1e6,
                  "ms_per_call": times, "loadavg": os.getloadavg(),
                  "staged_ratio_per_round": [s / m for s, m in zip(times["staged"],
                                                                   times["mapped"])],
                  "counts": cache.counts()}, indent=1))
