"""Compile and run time of the XLA expert paths (experts_sliced, experts_grouped) for a
family's own expert layout (gpt_oss, MXFP4) against plain SwiGLU experts, tiny shapes (16
experts, hidden 64, intermediate 32, top-4), N tokens (docs/lab/notes/cpu_speed.md, "Sliced experts of a
family's own layout"):  PYTHONPATH=. python docs/lab/runs/2026-12-04-sliced/experts_paths.py"""
import time
import numpy as np, jax
from moejax.model import experts as X
from moejax.model.families import gpt_oss
rng = np.random.default_rng(0)
E, D, I, K = 16, 64, 32, 4
w = {"gate_up": rng.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1,
     "down": rng.standard_normal((E, D, I)).astype(np.float32) * 0.1,
     "gate_up_bias": rng.standard_normal((E, 2 * I)).astype(np.float32) * 0.1,
     "down_bias": rng.standard_normal((E, D)).astype(np.float32) * 0.1}
q = gpt_oss.quantize_experts(w)



def paths(prefix, weights, ns, show_diff):
  """Both paths for N tokens in ns: compile time, and run time over 20 calls."""
  for n in ns:
    x = rng.standard_normal((n, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    g = rng.random((n, K)).astype(np.float32)
    res = {}
    for name, f in [("sliced", X.experts_sliced), ("grouped", X.experts_grouped)]:
      t = time.time(); c = jax.jit(f).lower(x, ids, g, weights).compile(); ct = time.time() - t
      c(x, ids, g, weights).block_until_ready()
      t = time.time()
      for _ in range(20): out = c(x, ids, g, weights)
      out.block_until_ready(); rt = (time.time() - t) / 20
      res[name] = np.asarray(out)
      print(f"{prefix}n={n:3d} {name:8s} compile {ct:6.2f}s run {rt*1e3:7.3f} ms")
    if show_diff:
      print("   max diff", np.abs(res["sliced"] - res["grouped"]).max())


paths("", q, [1, 2, 4, 8, 16, 32], True)
# plain SwiGLU experts (the CPU kernel's layout; XLA's paths where the kernel is not used)
paths("plain ", {"gate_up": w["gate_up"], "down": w["down"]}, [1, 2, 4, 8, 16], False)
