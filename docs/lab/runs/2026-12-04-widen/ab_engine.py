"""The Sampler against the all-resident lazy OffloadEngine (bench_peers' runners), one
process, alternating 128-token decodes after a 64-token prompt; per-round tok/s and the
median of the per-round ratios (docs/lab/notes/cpu_speed.md, "The bf16 widening"):

  PYTHONPATH=. python docs/lab/runs/2026-12-04-widen/ab_engine.py demo_bf16 20
"""
import sys, time, numpy as np
from absl import flags
from benchmarks import models as bench_models, peers as bp
FLAGS = flags.FLAGS
FLAGS(["x", "--decode_tokens=128"])
name = sys.argv[1]
rounds = int(sys.argv[2])
cfg, params, store, _, _ = bench_models.load(name)
dt = bench_models.split_name(name)[1]
smp = bp.SamplerRunner(cfg, params, store.to_device(), dt, 512)
eng = bp.EngineRunner(cfg, params, store, dt, 512, lazy=True)
prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, 64).astype(np.int32)
smp.decode(prompt); eng.decode(prompt)
s, e = [], []
for r in range(rounds):
  s.append(smp.decode(prompt)); e.append(eng.decode(prompt))
  print(f"round {r:2d} sampler {s[-1]:7.0f} engine {e[-1]:7.0f} ratio {e[-1]/s[-1]:.2f}", flush=True)
print("median ratio", np.median(np.array(e) / np.array(s)), "median smp", np.median(s), "eng", np.median(e))
