"""Child process of tests/test_disk_tier.py: loads a checkpoint, decodes under a policy and
prints one JSON line of anonymous-memory figures (bytes), so each run's RSS is its own.

  python tests/disk_tier_child.py MODEL_DIR STORE CACHE_FRACTION TOKENS [HOST_CACHE_GB]
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax.offload.memory import AnonWatch, status


def main(model_dir: str, store: str, fraction: float, tokens: int, host_cache_gb=None):
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.offload.engine import EngineConfig, OffloadEngine
  from moejax.offload.memory import plan_memory
  jnp.zeros(3).block_until_ready()                  # the runtime, before anything of ours
  start = status()["rss_anon"]
  with AnonWatch() as w:
    cfg, params, st = load_model(model_dir, dtype=jnp.bfloat16, mmap=store == "mmap",
                                 progress=False)
    with OffloadEngine(cfg, params, st, EngineConfig.make("quality", cache_fraction=fraction,
                                                          max_len=64, dtype=jnp.bfloat16,
                                                          link="native",
                                                          host_cache_gb=host_cache_gb)) as eng:
      eng.warmup()
      logits = eng.prefill(list(range(1, 9)))
      for _ in range(tokens):
        logits = eng.decode_step(int(logits.argmax()))
      staged = eng.staging.counts() if eng.staging else {}
  plan = plan_memory(cfg, jnp.bfloat16, store=store, cache_fraction=fraction, kv_len=64,
                     host_cache_gb=host_cache_gb)
  store_bytes = sum(v.nbytes for l in st.moe_layers for v in st.stacked(l).values())
  print(json.dumps({"start": start, "peak": w.peak_anon, "growth": w.peak_anon - start,
                    "store_bytes": store_bytes, "plan_anon": plan.anon_bytes,
                    "plan_cache": plan.expert_cache_bytes, "tokens": tokens,
                    "expert_bytes": plan.expert_bytes, **staged}))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
       float(sys.argv[5]) if len(sys.argv) > 5 else None)
