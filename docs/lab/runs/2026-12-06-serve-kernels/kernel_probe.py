import time, jax, jax.numpy as jnp, numpy as np
from moejax.kernels import cpu_kernel
cpu_kernel.available()
rng = np.random.default_rng(0)
def bench(f, x, n=7):
  f(x).block_until_ready(); best = 1e9
  for _ in range(n):
    t = time.perf_counter(); f(x).block_until_ready(); best = min(best, time.perf_counter() - t)
  return best / 200 * 1e6
E, D, I = 64, 128, 32
gu = jnp.asarray(rng.standard_normal((E, 2 * I, D)) * 0.1, jnp.float32)
dn = jnp.asarray(rng.standard_normal((E, D, I)) * 0.1, jnp.float32)
w = jnp.asarray(rng.standard_normal((8192, 128)) * 0.02, jnp.float32)
wbig = jnp.asarray(rng.standard_normal((4096, 2048)) * 0.02, jnp.float32)
out = []
with cpu_kernel.decoding():
  for N in (1, 8):
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:8] for _ in range(N)]), jnp.int32)
    g = jnp.full((N, 8), 0.125, jnp.float32)
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, x: x + 1e-9 * cpu_kernel._expert_call(x, ids, g, gu, dn), x))
    out.append(f"ffn N={N} {bench(f, x):.1f}")
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, x: x + 1e-9 * cpu_kernel.linear(x, w)[:, :128], x))
    out.append(f"lmhead N={N} {bench(f, x):.1f}")
  for N in (1,):
    x = jnp.asarray(rng.standard_normal((N, 2048)), jnp.float32)
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, x: x + 1e-9 * cpu_kernel.linear(x, wbig)[:, :2048], x))
    out.append(f"big32MB N={N} {bench(f, x, 3):.1f}")
print("  ".join(out))
