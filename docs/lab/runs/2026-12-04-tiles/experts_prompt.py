"""The routed experts of 8 bench-shape layers (hidden 512, 64 experts, top 8, I=256) over a
512-token prompt, uniform random routing: ms per pass and GFLOP/s of the expert kernel
(docs/lab/notes/cpu_speed.md, "Prompt tiles").  `python experts_prompt.py [ROUNDS] [bf16]`"""
import time, sys, numpy as np, jax, jax.numpy as jnp
from moejax.model import experts as E
rng = np.random.default_rng(0)
dt = jnp.bfloat16 if "bf16" in sys.argv else jnp.float32
N, D, I, NE, K = 512, 512, 256, 64, 8
L = 8
ws = [{"gate_up": jnp.asarray(rng.normal(size=(NE, 2*I, D)) * 0.05, dt),
       "down": jnp.asarray(rng.normal(size=(NE, D, I)) * 0.05, dt)} for _ in range(L)]
x = jnp.asarray(rng.normal(size=(N, D)), dt)
ids = jnp.asarray(np.stack([rng.permutation(NE)[:K] for _ in range(N)]), jnp.int32)
g = jnp.asarray(rng.random((N, K)), jnp.float32)
@jax.jit
def f(x, ws):
  for w in ws:
    x = x + E.apply_experts(x, ids, g, w).astype(x.dtype) * 0.01
  return x
r = f(x, ws).block_until_ready()
ts = []
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 7):
  t0 = time.perf_counter(); f(x, ws).block_until_ready(); ts.append(time.perf_counter() - t0)
fl = 2 * N * K * (2 * I * D + D * I) * L
print(f"{dt.__name__ if hasattr(dt,'__name__') else dt}: median {np.median(ts)*1e3:.1f} ms  min {min(ts)*1e3:.1f}  {fl/np.median(ts)/1e9:.1f} GFLOP/s", [round(t*1e3) for t in ts])
np.save("/tmp/pf/out_%s.npy" % ("bf16" if dt == jnp.bfloat16 else "f32"), np.asarray(r, np.float32))
