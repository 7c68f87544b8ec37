"""The routing statistics of a wide benchmark model on 2,048 held-out tokens, teacher-forced
in windows of 512 (what `launch.trace --text=held_out --max_tokens=2048 --seq=512` records),
read from an exact engine's records: `baseline` at 25% over the mapped store (exact: the selections are the router's whatever the budget), so a model
larger than RAM (24 layers, 30 GB) can be measured.  The first token of each window is its
prompt pass (not in the records): 2,044 tokens.

  PYTHONPATH=. python docs/lab/runs/2026-12-07-bench3/route_wide.py MODEL_DIR OUT.json
"""
import json
import sys
import time

import jax.numpy as jnp

from benchmarks import routing, stream
from moejax.io.loader import load_model
from moejax.kernels import cpu_kernel
from moejax.offload.engine import EngineConfig, OffloadEngine

model_dir, out = sys.argv[1], sys.argv[2]
cfg, params, store = load_model(model_dir, dtype=jnp.bfloat16, mmap=True, progress=False)
ids = stream.held_out_ids(f"{model_dir}/tokenizer.json", 2048)
records = []
t0 = time.time()
with OffloadEngine(cfg, params, store, EngineConfig.make(
    "baseline", cache_fraction=0.25, link="native", max_len=520, dtype=jnp.bfloat16)) as eng:
  eng.warmup()
  with cpu_kernel.decoding():
    for w in range(0, len(ids), 512):
      win = ids[w:w + 512]
      eng.prefill(win[:1])
      for tok in win[1:]:
        eng.decode_step(tok)
      records += eng.take_records()
      print(f"window {w // 512 + 1}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
      res = routing.seen(records, {}, cfg.num_experts)["stream"]   # written after each window
      res.update(model_dir=model_dir, layers=cfg.num_layers, windows=w // 512 + 1,
                 wall_s=time.time() - t0)
      with open(out, "w") as f:
        json.dump(res, f, indent=1)
print(json.dumps(res))
