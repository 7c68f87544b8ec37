"""The CPU kernels at Qwen3-30B-A3B's width, bf16 weights and activations, best of N:
a 4096 x 2048 linear (q_proj's shape) at 1-512 rows, kernel against XLA's GEMM; the
routed-expert kernel (128 experts of 768, top-8) at 1 and 512 tokens.
PYTHONPATH=. python docs/lab/runs/2026-12-06-avx512/kernels.py [--rows=1,8,64,512]"""
import sys, time, json, jax, jax.numpy as jnp, numpy as np
from moejax.kernels import cpu_kernel
assert cpu_kernel.available()
rng = np.random.default_rng(0)
rows = [int(v) for v in (sys.argv[1].split("=")[1] if len(sys.argv) > 1 else "1,8,64,512").split(",")]

def bench(f, *a, n=7):
  jax.block_until_ready(f(*a)); ts = []
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
  return 1e3 * min(ts)

out = {}
w = jnp.asarray(rng.standard_normal((4096, 2048)) * 0.02, jnp.bfloat16)
cpu_kernel.LINEAR_MAX_TOKENS_BF16 = 100000
xla = jax.jit(lambda x, w: jnp.einsum("nd,od->no", x, w))
ker = jax.jit(lambda x, w: cpu_kernel.linear(x, w))
for n in rows:
  x = jnp.asarray(rng.standard_normal((n, 2048)), jnp.bfloat16)
  a, b = bench(xla, x, w), bench(ker, x, w)
  gf = 2 * n * 2048 * 4096 / 1e6
  print("linear 4096x2048 N=%-4d xla %7.2f ms (%4.0f GFLOP/s)  kernel %7.2f ms (%4.0f GFLOP/s, %5.1f GB/s)"
        % (n, a, gf / a, b, gf / b, 4096 * 2048 * 2 / b / 1e6))
  out[f"linear_{n}"] = {"xla_ms": a, "kernel_ms": b}
E, I, D, K = 128, 768, 2048, 8
gu = jnp.asarray(rng.standard_normal((E, 2 * I, D)) * 0.02, jnp.bfloat16)
dn = jnp.asarray(rng.standard_normal((E, D, I)) * 0.02, jnp.bfloat16)
f = jax.jit(lambda x, ids, g: cpu_kernel._expert_call(x, ids, g, gu, dn))
for n in (1, 512):
  x = jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(n)]), jnp.int32)
  g = jnp.full((n, K), 1.0 / K, jnp.float32)
  b = bench(f, x, ids, g)
  gf = n * K * 3 * I * D * 2 / 1e6
  print("experts N=%-4d %7.2f ms (%4.0f GFLOP/s)" % (n, b, gf / b))
  out[f"experts_{n}"] = {"kernel_ms": b}
print(json.dumps(out))
