"""The batched offload decode step alone, batch 1 and 8 (BS), demo model, --link=native:
the best of six rounds' median step time over 40 steps each.  Run from a checkout root."""
import time, sys, numpy as np, jax
from moejax.io.loader import load_model
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.kernels import cpu_kernel
cfg, params, store = load_model("ckpts/demo")
rng = np.random.default_rng(0)
pol = sys.argv[1] if len(sys.argv) > 1 else "quality"
frac = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
import os
for B in [int(x) for x in os.environ.get("BS", "1,8").split(",")]:
  eng = OffloadEngine(cfg, params, store, EngineConfig.make(pol, cache_fraction=frac, max_len=512, link="native"))
  b = eng.batched(B)
  for r in range(B):
    b.prompt([int(t) for t in rng.integers(1, 8000, 12)], row=r)
  valid = np.ones(B, bool)
  toks = rng.integers(1, 8000, B).astype(np.int32)
  for _ in range(10): lg = b.step(toks, valid)
  meds = []
  with cpu_kernel.decoding():
    for r in range(6):
      ts = []
      for _ in range(40):
        t = time.perf_counter(); lg = b.step(toks, valid); ts.append(time.perf_counter() - t)
        toks = np.argmax(lg, -1).astype(np.int32)
      meds.append(np.median(ts))
      b.take_records(layers=False)
  print(pol, frac, B, "step: best round median %.3f ms, rounds %s" % (1e3 * min(meds), " ".join("%.2f" % (1e3*m) for m in meds)))
  eng.close()
