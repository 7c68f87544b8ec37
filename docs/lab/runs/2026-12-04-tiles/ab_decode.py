"""Decode speed of model variants in one process, alternating chunks of 128 greedy tokens
(docs/lab/notes/cpu_speed.md, "The bf16 embedding lookup").  Each spec is MODEL[:VARIANT]; VARIANT
`u16` runs the bf16 embedding lookup as XLA's uint16 gather instead of the kernel.

  python docs/lab/runs/2026-12-04-tiles/ab_decode.py demo_bf16:u16,demo_bf16,demo_f32 30
"""
import sys, time, numpy as np, jax, jax.numpy as jnp
from benchmarks import models as bench_models
from moejax.kernels import cpu_rows
from moejax.model import model as M, sampler as S

_take = cpu_rows.take_rows
FLAG = {"u16": False}   # read while tracing: each variant has its own jitted step
M.cpu_rows.take_rows = lambda t, i, f: f(t, i) if FLAG["u16"] else _take(t, i, f)


def make(name, u16):
  cfg, params, store, _, _ = bench_models.load(name)
  dt = bench_models.split_name(name)[1]
  model, experts = M.Transformer(cfg, dt), store.to_device()

  def step(params, experts, cache, tok, end):
    FLAG["u16"] = u16
    logits, cache, _ = model.apply({"params": params}, tok[:, None], experts, cache, end)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

  fn = jax.jit(step, donate_argnums=(2,))
  s = S.Sampler(cfg, params, experts, max_len=512, dtype=dt)
  prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 64)).astype(np.int32)

  def run(n):
    logits, cache = s.prefill(prompt)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    tok.block_until_ready()
    t0 = time.perf_counter()
    for i in range(n):
      tok, cache = fn(params, experts, cache, tok, np.int32(64 + i))
    tok.block_until_ready()
    return (time.perf_counter() - t0) / n
  return run


runs = {spec: make(spec.split(":")[0], spec.endswith(":u16")) for spec in sys.argv[1].split(",")}
for r in runs.values():
  r(16)
res = {k: [] for k in runs}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 12):
  for k, r in runs.items():
    res[k].append(r(128))
for k, v in res.items():
  print(f"{k:18s} median {np.median(v) * 1e6:6.0f} us/token ({1 / np.median(v):5.0f} tok/s)"
        f"  min {min(v) * 1e6:.0f}")
