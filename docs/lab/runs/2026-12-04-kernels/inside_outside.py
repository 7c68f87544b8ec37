"""Sampler decode tok/s (128 greedy steps after 64 tokens, a loop of decode_step as
bench_peers runs it) inside and outside cpu_kernel.decoding(), alternately, N rounds:
`python inside_outside.py <model> [rounds]` from the checkout root."""
import json, statistics, sys, time
import jax, jax.numpy as jnp
sys.path.insert(0, ".")
from benchmarks import models as bench_models
from moejax.kernels import cpu_kernel
from moejax.model.sampler import Sampler, SamplingParams

name, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
cfg, params, store, _, _ = bench_models.load(name)
_, dtype = bench_models.split_name(name)
s = Sampler(cfg, params, store.to_device(), max_len=256, dtype=dtype)
prompt = jnp.arange(64, dtype=jnp.int32)[None] % cfg.vocab_size


def rate():
  logits, cache = s.prefill(prompt)
  tok, key, sp = jnp.argmax(logits, -1).astype(jnp.int32), jax.random.PRNGKey(0), SamplingParams()
  tok.block_until_ready()
  t = time.perf_counter()
  for i in range(128):
    tok, _, cache = s.decode_step(cache, tok, 64 + i, sp, key)
  tok.block_until_ready()
  return 128 / (time.perf_counter() - t)


rate()
res = {"inside": [], "outside": []}
for _ in range(rounds):
  with cpu_kernel.decoding():
    res["inside"].append(rate())
  res["outside"].append(rate())
print(json.dumps({"model": name, **{k: {"median": statistics.median(v), "best": max(v),
                                         "rounds": v} for k, v in res.items()}}))
