"""Where the all-resident engine's decode time goes on this backend (issue 16 GPU check)."""
import json, os, sys, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd())
from benchmarks import models as bench_models
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.offload import runs as runs_lib
from moejax.model.sampler import Sampler, SamplingParams, next_token
res = {"device": str(jax.devices()[0]), "jax": jax.__version__}
N = 256
for name in sys.argv[1].split(","):
  cfg, params, store, _, _ = bench_models.load(name)
  dtype = bench_models.split_name(name)[1]
  eng = OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=1.0,
                                                            max_len=1024, dtype=dtype))
  eng.warmup()
  s = Sampler(cfg, params, store.to_device(), max_len=1024, dtype=dtype)
  key = jax.random.PRNGKey(0); sp = SamplingParams()
  prompt = list(range(1, 65))
  def engine_lazy():
    tok = next_token(eng.prefill(prompt), key, 0.0, 1.0); tok.block_until_ready()
    t = time.perf_counter(); py = 0.0
    for _ in range(N):
      t1 = time.perf_counter(); lg = eng.decode_step(tok, lazy=True); py += time.perf_counter() - t1
      tok = next_token(lg, key, 0.0, 1.0)
    tok.block_until_ready(); tot = time.perf_counter() - t; eng.records
    return tot / N * 1e3, py / N * 1e3
  def engine_sync():   # each step waited for: the device time of one step + dispatch
    tok = next_token(eng.prefill(prompt), key, 0.0, 1.0); tok.block_until_ready()
    t = time.perf_counter()
    for _ in range(N // 4):
      tok = next_token(eng.decode_step(tok, lazy=True), key, 0.0, 1.0); tok.block_until_ready()
    r = (time.perf_counter() - t) / (N // 4) * 1e3; eng.records; return r
  def sampler(sync=False):
    logits, cache = s.prefill(np.asarray([prompt], np.int32)); st = jnp.argmax(logits, -1).astype(jnp.int32)
    st.block_until_ready(); t = time.perf_counter(); py = 0.0
    n = N // 4 if sync else N
    for i in range(n):
      t1 = time.perf_counter(); st, _, cache = s.decode_step(cache, st, 64 + i, sp, key); py += time.perf_counter() - t1
      if sync: st.block_until_ready()
    st.block_until_ready(); return (time.perf_counter() - t) / n * 1e3, py / n * 1e3
  out = {k: [] for k in ("engine_ms", "engine_py_ms", "engine_sync_ms", "sampler_ms", "sampler_py_ms", "sampler_sync_ms")}
  for r in range(4):
    a = engine_lazy(); b = engine_sync(); c = sampler(); d = sampler(True)
    if r == 0: continue
    for k, v in zip(out, (a[0], a[1], b, c[0], c[1], d[0])): out[k].append(round(v, 4))
  res[name] = out
  print(name, json.dumps(out), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "split_gpu.json"), "w"), indent=1)
