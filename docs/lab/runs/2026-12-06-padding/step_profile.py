"""The batched offload step on the demo model: median step time over 40 steps, then the time per
HLO op and per custom-call target over 40 profiled steps (jax.profiler; the targets from XLA's
dump).  Run from a checkout root: python docs/lab/runs/2026-12-06-padding/step_profile.py quality 0.25 8
(MOEJAX_CPU_SPIN_US=0 etc. in the environment for the variants in the README)."""
import os, sys, time, glob, gzip, json, collections, re, shutil
DUMP, PROF = "/tmp/step_profile_dump", "/tmp/step_profile"
shutil.rmtree(DUMP, ignore_errors=True)
os.environ["XLA_FLAGS"] = f"--xla_dump_to={DUMP} --xla_dump_hlo_as_text"
import numpy as np, jax
from moejax.io.loader import load_model
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.kernels import cpu_kernel
cfg, params, store = load_model("ckpts/demo")
rng = np.random.default_rng(0)
pol, frac, B = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
eng = OffloadEngine(cfg, params, store, EngineConfig.make(pol, cache_fraction=frac, max_len=512, link="native"))
b = eng.batched(B)
for r in range(B): b.prompt([int(t) for t in rng.integers(1, 8000, 12)], row=r)
valid = np.ones(B, bool); toks = rng.integers(1, 8000, B).astype(np.int32)
for _ in range(10): lg = b.step(toks, valid)
N = 40
with cpu_kernel.decoding():
  ts = []
  for _ in range(N):
    t = time.perf_counter(); lg = b.step(toks, valid); ts.append(time.perf_counter() - t)
    toks = np.argmax(lg, -1).astype(np.int32)
  print("median step ms %.3f" % (1e3 * np.median(ts)))
  shutil.rmtree(PROF, ignore_errors=True)
  jax.profiler.start_trace(PROF)
  for _ in range(N): lg = b.step(toks, valid); toks = np.argmax(lg, -1).astype(np.int32)
  jax.profiler.stop_trace()
tgt = {}
for fn in glob.glob(f"{DUMP}/*jit__decode.cpu_after_optimizations.txt"):
  for m in re.finditer(r"(ffi_call(?:\.\d+)?) = .*?custom_call_target=\"([^\"]+)\"", open(fn).read()):
    tgt[m.group(1)] = m.group(2)
ev = json.load(gzip.open(sorted(glob.glob(f"{PROF}/**/*.trace.json.gz", recursive=True))[-1]))["traceEvents"]
tot, cnt = collections.Counter(), collections.Counter()
for e in ev:
  op = (e.get("args") or {}).get("hlo_op")
  if e.get("ph") != "X" or not op or re.match(r"(while|cond|call|conditional)(\.\d+)?$", op):
    continue
  k = tgt.get(op, re.sub(r"\.\d+$", "", op)); tot[k] += e["dur"]; cnt[k] += 1
print("ops summed over threads: %.0f us a step" % (sum(tot.values()) / N))
for k, t in tot.most_common(16): print("%9.1f us/step %6.1f calls  %s" % (t / N, cnt[k] / N, k))
eng.close()
