"""On a GPU: the bf16 embedding lookup falls back to XLA's gather (no custom call in the
compiled step, same rows as jnp.take) and the demo model generates in bf16 and f32; then the
Sampler's decode speed on the demo model (bf16, f32) and the bench shape (f32).

  python docs/lab/runs/2026-12-04-tiles/gpu_check.py
"""
import json, time
import numpy as np, jax, jax.numpy as jnp
from benchmarks import models as bench_models
from moejax.model import model as M, sampler as S

out = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
for name in ("demo_bf16", "demo_f32", "bench_f32"):
  cfg, params, store, _, _ = bench_models.load(name)
  dt = bench_models.split_name(name)[1]
  s = S.Sampler(cfg, params, store.to_device(), max_len=256, dtype=dt)
  cache = S.init_cache(cfg, 1, 256, dt)
  hlo = S.decode_sample.lower(s.model, s.params, s.experts, cache, jnp.zeros((1,), jnp.int32),
                              np.int32(5), jax.random.PRNGKey(0), temperature=0.0,
                              top_p=1.0).compile().as_text()
  tok = jnp.asarray([[3, 7, 4095]], jnp.int32)
  rows = s.model.apply({"params": s.params}, tok, method=M.Transformer.embed)
  want = jnp.take(s.params["embed_tokens"]["embedding"], tok, axis=0)
  prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 64)).astype(np.int32)
  sp = S.SamplingParams(temperature=0.0, max_new_tokens=128)
  s.generate(list(prompt[0]), sp)            # compile
  t0 = time.perf_counter()
  ids = s.generate(list(prompt[0]), sp)
  dt_s = time.perf_counter() - t0
  out[name] = {"moejax_custom_calls": hlo.count("custom_call_target=\"moejax_"),
               "embed_equals_take": bool(jnp.array_equal(rows, want)),
               "generated": len(ids), "decode_tok_s_with_prefill": len(ids) / dt_s}
  print(name, out[name], flush=True)
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_check.json"), "w"), indent=1)
