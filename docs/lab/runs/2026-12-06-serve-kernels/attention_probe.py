import time, jax, jax.numpy as jnp, numpy as np
from moejax.kernels import cpu_attention, cpu_kernel
cpu_kernel.available()
with cpu_kernel.decoding():
 for b in (1, 8):
     for P in (50, 250, 500, 1000):
      rng = np.random.default_rng(0)
      q = jnp.asarray(rng.standard_normal((b, 1, 4, 32)), jnp.float32)
      k = jnp.asarray(rng.standard_normal((b, 1024, 2, 32)), jnp.float32)
      v = jnp.asarray(rng.standard_normal((b, 1024, 2, 32)), jnp.float32)
      pos = jnp.full((b, 1), P, jnp.int32)
      def body(i, q):
        o = cpu_attention.decode_attention(q, k, v, pos, 0.17, None, None, lambda: jnp.zeros((q.shape[0], 1, 128), q.dtype))
        return q + 1e-9 * o.reshape(q.shape)
      f = jax.jit(lambda q: jax.lax.fori_loop(0, 200, body, q))
      f(q).block_until_ready()
      best = 1e9
      for _ in range(5):
        t = time.perf_counter(); f(q).block_until_ready(); best = min(best, time.perf_counter() - t)
      print(f"b={b} pos={P}: {best/200*1e6:.1f} us")
