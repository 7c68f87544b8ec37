# The Sampler on wide_bf16 at --max_len 2048 after a 1536-token prompt: tok/s, then (with an
# argument) a jax.profiler trace of 16 tokens in /tmp/prof_wide (calls_in_order.py reads it).
# PYTHONPATH=. python docs/lab/runs/2026-12-06-attention/decode_profile.py p
import time, sys, numpy as np, jax, jax.numpy as jnp
from benchmarks import models as bench_models
from moejax.model.sampler import Sampler, SamplingParams
from moejax.kernels import cpu_kernel
from leaf_ops import leaf_ops
cfg, params, store, hf_dir, tok_path = bench_models.load("wide_bf16", None)
s = Sampler(cfg, params, store.device_experts(), max_len=2048, dtype=jnp.bfloat16)
prompt = np.arange(1, 1537, dtype=np.int32)
logits, cache = s.prefill(prompt[None])
tok = jnp.argmax(logits, -1).astype(jnp.int32)
key, sp = jax.random.PRNGKey(0), SamplingParams()
with cpu_kernel.decoding():
  for i in range(8): tok, _, cache = s.decode_step(cache, tok, 1536 + i, sp, key)
  tok.block_until_ready()
  for r in range(3):
    t = time.perf_counter()
    for i in range(32): tok, _, cache = s.decode_step(cache, tok, 1544 + 32*r + i, sp, key)
    tok.block_until_ready(); print("tok/s %.1f" % (32 / (time.perf_counter() - t)))
  if len(sys.argv) > 1:
    d = "/tmp/prof_wide"
    jax.profiler.start_trace(d)
    for i in range(16): tok, _, cache = s.decode_step(cache, tok, 1700 + i, sp, key)
    tok.block_until_ready()
    jax.profiler.stop_trace()
    tot, cnt = leaf_ops(d)
    print("leaf total %.0f us/token" % (sum(tot.values()) / 16))
    for k, t in tot.most_common(20): print("%9.1f us/token %4d  %s" % (t / 16, cnt[k] // 16, k))
    # per target
    import jax
    txt = s_hlo = None
