"""A 4096 x 2048 bf16 linear at 16-256 rows: XLA's GEMM (einsum) against the kernel (LINEAR_MAX_TOKENS raised
for the probe), best of 5.  python docs/lab/runs/2026-12-06-padding/linear_rows.py"""
import time, jax, jax.numpy as jnp, numpy as np
from moejax.kernels import cpu_kernel
cpu_kernel.available()
rng = np.random.default_rng(0)
def bench(f, *a, n=5):
  jax.block_until_ready(f(*a)); ts=[]
  for _ in range(n):
    t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
  return 1e3*min(ts)
w = jnp.asarray(rng.standard_normal((4096, 2048)) * 0.02, jnp.bfloat16)
for N in (16, 32, 64, 128, 256):
  x = jnp.asarray(rng.standard_normal((N, 2048)), jnp.bfloat16)
  xla = jax.jit(lambda x, w: jnp.einsum("nd,od->no", x, w))
  cpu_kernel.LINEAR_MAX_TOKENS = 100000
  ker = jax.jit(lambda x, w: cpu_kernel.linear(x, w))
  a, b = bench(xla, x, w), bench(ker, x, w)
  d = np.abs(np.asarray(xla(x, w), np.float32) - np.asarray(ker(x, w), np.float32)).max()
  print("N=%d xla %.1f ms kernel %.1f ms (GFLOP/s %.0f / %.0f) maxdiff %.3g" % (N, a, b, 2*N*2048*4096/a/1e6, 2*N*2048*4096/b/1e6, d))
