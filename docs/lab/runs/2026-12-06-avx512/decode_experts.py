"""One decoded token's routed experts at Qwen3-30B-A3B's width (128 x 768, top-8, bf16), 64 calls with random ids
inside cpu_kernel.decoding().  PYTHONPATH=. python docs/lab/runs/2026-12-06-avx512/decode_experts.py"""
import time, jax, jax.numpy as jnp, numpy as np
from moejax.kernels import cpu_kernel
assert cpu_kernel.available()
rng = np.random.default_rng(0)
E, I, D, K = 128, 768, 2048, 8
gu = jnp.asarray(rng.standard_normal((E, 2 * I, D)) * 0.02, jnp.bfloat16)
dn = jnp.asarray(rng.standard_normal((E, D, I)) * 0.02, jnp.bfloat16)
f = jax.jit(lambda x, ids, g: cpu_kernel._expert_call(x, ids, g, gu, dn))
x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
g = jnp.full((1, K), 1.0 / K, jnp.float32)
idss = [jnp.asarray(rng.choice(E, K, replace=False)[None], jnp.int32) for _ in range(64)]
with cpu_kernel.decoding():
  for rep in range(3):
    jax.block_until_ready(f(x, idss[0], g))
    t = time.perf_counter()
    for i in idss: y = f(x, i, g)
    jax.block_until_ready(y)
    dt = (time.perf_counter() - t) / len(idss) * 1e3
    print("decode experts (random ids, decoding): %.3f ms  %.1f GB/s" % (dt, K * 3 * I * D * 2 / dt / 1e6))
