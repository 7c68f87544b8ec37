"""Why the offloaded presets were slow on the H200 (gpu_check run 1): the copy mechanism.

  PYTHONPATH=. python docs/lab/runs/2026-12-04-engine3/gpu_copies.py OUT_DIR [--quick]

Qwen3-30B-A3B shape, 4 layers, bf16, pinned_host store, substitute_all at 25% (no fetch,
no admission: every copy call copies nothing).  Per variant of the copy step the time per
token and, in the compiled program, the big copies and the conditionals/loops:
  gpu_default  inserts unconditional, the copy loop (the accelerator default)
  loops    conds around the inserts (skipped when empty) + the copy loop (the CPU default)
  none     no copy step at all (a bound: wrong results once something is fetched)
"""
import dataclasses, json, os, re, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.argv += [] if len(sys.argv) > 1 else ["."]
src = open(os.path.join(os.path.dirname(__file__), "gpu_check.py")).read().split("for part in (exactness")[0]
g = {}
exec(compile(src, "gpu_check", "exec"), g)
from moejax.io import store as host_store
from moejax.offload import decode, layer as L
from moejax.offload.engine import EngineConfig, OffloadEngine
OUT, QUICK = g["OUT"], g["QUICK"]
cfg = (g["cfg_of"](4, 256, 4, 2, 64, 32, 8, 128, 1024) if QUICK
       else g["cfg_of"](4, 2048, 32, 4, 128, 128, 8, 768, 151936))
params, store = g["random_model"](cfg, jnp.bfloat16, 2)
pinned = host_store.make_store(store, "pinned_host")
toks = np.random.default_rng(1).integers(0, cfg.vocab_size, 100).tolist()
res = {}
orig = L.copy_rows
for variant, pol in (("gpu_default", "substitute_all"), ("loops", "substitute_all"),
                     ("none", "substitute_all"), ("loops", "quality"), ("gpu_default", "quality")):
  if time.perf_counter() - g["T0"] > 240:
    break
  if True:
    L.copy_rows = (lambda b, *a, **k: b) if variant == "none" else orig
    with OffloadEngine(cfg, params, pinned, EngineConfig.make(pol, cache_fraction=0.25,
                                                              max_len=128 + (variant == "none"),
                                                              dtype=jnp.bfloat16)) as eng:
      eng._prog = dataclasses.replace(eng._prog, ctx=dataclasses.replace(
          eng._prog.ctx, skip_empty=variant == "loops"))
      eng._step = decode.step_fn(eng._prog)
      t0 = time.perf_counter(); eng.warmup(); comp = time.perf_counter() - t0
      eng.prefill(toks[:16])
      for i in range(8): eng.decode_step(toks[16 + i])
      t = time.perf_counter()
      for i in range(24): eng.decode_step(toks[24 + i])
      ms = (time.perf_counter() - t) / 24 * 1e3
      hlo = decode.step_fn(eng._prog).lower(eng.params, eng._srcs, eng._carry, np.int32(1),
                                            np.int32(50)).compile().as_text()
      big = [l.split("=")[1].split("{")[0].strip() for l in hlo.splitlines()
             if re.search(r" copy(-start)?\(", l) and re.search(r"\[\d+,\d+,\d+\]", l)]
      res[f"{variant}/{pol}"] = dict(tpot_ms=ms, compile_s=comp, big_copies=big[:12],
                                    n_big_copies=len(big),
                                    conditionals=hlo.count(" conditional("), whiles=hlo.count(" while("),
                                    fetches_per_token=eng.stats()["fetches_per_token"])
      print(variant, pol, res[f"{variant}/{pol}"], flush=True)
      with open(os.path.join(OUT, "gpu_copies.json"), "w") as f:
        json.dump(res, f, indent=1)
L.copy_rows = orig
with open(os.path.join(OUT, "gpu_copies.json"), "w") as f:
  json.dump(res, f, indent=1)
