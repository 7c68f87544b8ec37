"""The engine's decode alone (a preset at 25%, or "all" resident) on a wide GGUF: N
teacher-forced held-out tokens in 3 timed thirds. NOCOPY=1 replaces the in-program expert
copy by nothing (wrong outputs, the same work otherwise): the copies' share of a token.

    PYTHONPATH=. python docs/lab/runs/2026-12-08-panels/engine_probe.py wide_q4_0 baseline 300
"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from benchmarks import models as bench_models, stream
from moejax.io.loader import load_model
from moejax.io.weights import gguf_file
from moejax.io.store import make_store
from moejax.offload import calibrate
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.kernels import cpu_kernel
import os
if os.environ.get("NOCOPY"):
  from moejax.kernels import cpu_rows
  cpu_rows.copy_rows = lambda dst, dst_start, src, src_start, xla_fn: dst
name, preset, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
gguf = bench_models.wide_gguf(4, bench_models.weights_of(name), root=bench_models.WIDE_DIR)
cfg, params, store = load_model(gguf, dtype=jnp.bfloat16, mmap=True)
tok = gguf_file.tokenizer_path(gguf)
prof, ids = stream.calibration_ids(tok, 64 + n), stream.held_out_ids(tok, 64 + n)
counts = calibrate.profile_counts(cfg, params, store, prof, jnp.bfloat16)
store = make_store(store, "mmap")
frac = 0.25 if preset != "all" else 1.0
config = EngineConfig.make("baseline" if preset == "all" else preset, cache_fraction=frac,
                           max_len=len(ids) + 8, dtype=jnp.bfloat16, initial="profile" if frac < 1 else "auto")
with cpu_kernel.decoding(), OffloadEngine(cfg, params, store, config, counts=counts if frac < 1 else None) as eng:
  eng.warmup(); eng.prefill(ids[:32])
  for rep in range(3):
    t0 = time.perf_counter()
    for t in ids[32 + rep * n // 3: 32 + (rep + 1) * n // 3]:
      eng.decode_step(t)
    dt = time.perf_counter() - t0
    print(f"{preset}: {1e3 * dt / (n // 3):.2f} ms/token", flush=True)
