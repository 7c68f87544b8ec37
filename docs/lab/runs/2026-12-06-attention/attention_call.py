# The decode-attention call alone at the wide shape (32 heads, 4 KV groups, head dim 128, bf16),
# 100 calls in one program: python attention_call.py S POS
import time, numpy as np, jax, jax.numpy as jnp
from moejax.kernels import cpu_attention, cpu_kernel
from moejax.model import layers
import sys
S = int(sys.argv[1]) if len(sys.argv) > 1 else 256
P = int(sys.argv[2]) if len(sys.argv) > 2 else 200
rng = np.random.default_rng(0)
cpu_kernel.available()
dt = jnp.bfloat16
q = jnp.asarray(rng.standard_normal((1, 1, 32, 128)), dt)
k = jnp.asarray(rng.standard_normal((1, S, 4, 128)), dt)
v = jnp.asarray(rng.standard_normal((1, S, 4, 128)), dt)
pos = jnp.array([[P]], jnp.int32)
def xla(q, k, v, p):
  kp = layers.cache_positions(v, 1); return layers.gqa_attention(q, k, v, p, kp, 128 ** -0.5, None, None)
f = jax.jit(lambda q, k, v, p: cpu_attention.decode_attention(q, k, v, p, 128 ** -0.5, None, None, lambda: xla(q, k, v, p)))
def loop(q, k, v, p):
  def body(i, q):
    return f(q, k, v, p).reshape(q.shape).astype(q.dtype)
  return jax.lax.fori_loop(0, 100, body, q)
g = jax.jit(loop)
with cpu_kernel.decoding():
  g(q, k, v, pos).block_until_ready()
  for r in range(5):
    t = time.perf_counter(); g(q, k, v, pos).block_until_ready(); print("S=%d pos=%d %.1f us/call" % (S, P, (time.perf_counter() - t) / 100 * 1e6))
