"""Anonymous RSS after each phase of an offload engine on an 806 MB per-expert bf16 checkpoint (test_disk_tier's
model: tests.test_disk_tier.write(config(1024, 512), DIR)), quality 12.5%, mmap store: load, engine, warmup
(compile), an 8-token prompt, 8 decode steps.  From a checkout root:
MOEJAX_CPU_KERNEL=0 SCAN=1|0 PYTHONPATH=. python docs/lab/runs/2026-12-06-padding/prompt_memory.py DIR"""
import sys, os
import jax.numpy as jnp
from moejax.offload.memory import AnonWatch, status
from moejax.io.loader import load_model
from moejax.offload.engine import EngineConfig, OffloadEngine
d = sys.argv[1]
jnp.zeros(3).block_until_ready()
mb = lambda: round(status()["rss_anon"] / 1e6)
print("start", mb())
with AnonWatch() as w:
  cfg, params, st = load_model(d, dtype=jnp.bfloat16, mmap=True, progress=False)
  print("loaded", mb(), "peak", round(w.peak_anon/1e6))
  eng = OffloadEngine(cfg, params, st, EngineConfig.make("quality", cache_fraction=0.125, max_len=64, dtype=jnp.bfloat16, link="native", layer_scan=os.environ.get("SCAN","1")=="1"))
  print("engine", mb(), "peak", round(w.peak_anon/1e6), "scan", eng.program.scan)
  eng.warmup(); print("warm", mb(), "peak", round(w.peak_anon/1e6))
  lg = eng.prefill(list(range(1, 9))); print("prefill", mb(), "peak", round(w.peak_anon/1e6))
  for _ in range(8): lg = eng.decode_step(int(lg.argmax()))
  print("decode", mb(), "peak", round(w.peak_anon/1e6))
