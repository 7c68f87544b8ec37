"""Before/after of the resident decode and prefill paths, interleaved in one run.

  python -m launch.bench_speed --out=bench_speed.json

Variants, each compiled once and then timed in turn (round robin, so the load of a
shared machine falls on all alike):
  xla          XLA's expert dispatch (dynamic slice per expert / grouped blocks) and the
               LM head over every prompt position: the code before the CPU kernel
  kernel       the C++ expert kernel (moejax.kernels.cpu_kernel), LM head over every position
  kernel_last  the kernel and the LM head at the last prompt position only (the Sampler now)
Decode: --decode_tokens greedy tokens after a --prompt_len prompt (tok/s, best round).
Prefill: one --prefill_len prompt (tok/s, best round).  The load average is recorded.
"""

from __future__ import annotations

import functools
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks import models as bench_models
from moejax.kernels import cpu_kernel
from moejax.model import sampler as sampler_lib
from moejax.model.model import Transformer, init_cache

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_speed.json", "JSON results file.")
flags.DEFINE_list("models", ["bench_f32", "demo_f32", "demo_bf16"],
                  f"Models to time: {', '.join(bench_models.NAMES)}.")
flags.DEFINE_string("demo_dir", bench_models.DEMO_DIR, "The demo checkpoint.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens before decoding.")
flags.DEFINE_integer("decode_tokens", 128, "Decoded tokens timed.")
flags.DEFINE_integer("prefill_len", 512, "Prompt length of the prefill measurement.")
flags.DEFINE_integer("rounds", 3, "Timed rounds per variant (interleaved).")

VARIANTS = {"xla": (False, False), "kernel": (True, False), "kernel_last": (True, True)}


def _prefill_every_position(model, params, experts, cache, tokens_BxT, last):
  """The previous prefill: logits at every position, then the last one taken."""
  logits, cache, _ = model.apply({"params": params}, tokens_BxT, experts, cache, 0)
  return jax.lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False), cache


class Variant:
  """A variant's decode and prefill steps, compiled with the kernel on or off."""

  def __init__(self, cfg, dtype, params, experts, kernel: bool, last_only: bool, max_len: int):
    self.cfg, self.dtype, self.params, self.experts = cfg, dtype, params, experts
    model = Transformer(cfg, dtype)
    dec = functools.partial(sampler_lib.decode_sample.__wrapped__, model, temperature=0.0,
                            top_p=1.0)
    pre = functools.partial(sampler_lib.prefill_logits.__wrapped__ if last_only
                            else _prefill_every_position, model)
    self.max_len = max_len
    tok = jnp.zeros((1,), jnp.int32)
    with cpu_kernel.enabled(kernel):  # the choice is made while tracing
      self.decode = jax.jit(dec, donate_argnums=(2,)).lower(
          params, experts, self.cache(), tok, jnp.int32(0), jax.random.PRNGKey(0)).compile()
      self.prefill = {}
      for n in (FLAGS.prompt_len, FLAGS.prefill_len):
        toks = jnp.zeros((1, n), jnp.int32)
        self.prefill[n] = jax.jit(pre, donate_argnums=(2,)).lower(
            params, experts, self.cache(), toks, jnp.int32(n - 1)).compile()

  def cache(self):
    return init_cache(self.cfg, 1, self.max_len, self.dtype)

  def time_decode(self, prompt_1xT) -> float:
    t = prompt_1xT.shape[1]
    logits, cache = self.prefill[t](self.params, self.experts, self.cache(), prompt_1xT,
                                    jnp.int32(t - 1))
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    key = jax.random.PRNGKey(0)
    tok.block_until_ready()
    t0 = time.perf_counter()
    for i in range(FLAGS.decode_tokens):
      tok, _, cache = self.decode(self.params, self.experts, cache, tok, jnp.int32(t + i), key)
    tok.block_until_ready()
    return FLAGS.decode_tokens / (time.perf_counter() - t0)

  def time_prefill(self, prompt_1xT) -> float:
    t = prompt_1xT.shape[1]
    cache = self.cache()
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    logits, _ = self.prefill[t](self.params, self.experts, cache, prompt_1xT, jnp.int32(t - 1))
    logits.block_until_ready()
    return t / (time.perf_counter() - t0)


def bench_model(name: str) -> dict:
  cfg, params, store, _, _ = bench_models.load(name, FLAGS.demo_dir)
  experts = store.to_device()
  dtype = bench_models.split_name(name)[1]
  max_len = max(FLAGS.prompt_len + FLAGS.decode_tokens, FLAGS.prefill_len) + 8
  variants = {v: Variant(cfg, dtype, params, experts, k, last, max_len)
              for v, (k, last) in tqdm(VARIANTS.items(), desc=f"{name}: compile")}
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, FLAGS.prompt_len)), jnp.int32)
  long = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, FLAGS.prefill_len)), jnp.int32)
  for v in variants.values():  # warm-up
    v.time_decode(prompt)
    v.time_prefill(long)
  dec = {v: [] for v in variants}
  pre = {v: [] for v in variants}
  for _ in tqdm(range(FLAGS.rounds), desc=f"{name}: rounds"):
    for v, var in variants.items():
      if v != "kernel_last":  # decode does not depend on the prefill's LM head
        dec[v].append(var.time_decode(prompt))
      pre[v].append(var.time_prefill(long))
  out = {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "experts": cfg.num_experts,
         "top_k": cfg.top_k, "expert_size": cfg.moe_intermediate_size,
         "vocab": cfg.vocab_size, "dtype": jnp.dtype(dtype).name, "variants": {}}
  for v in variants:
    out["variants"][v] = {"decode_tok_s": max(dec[v]) if dec[v] else None,
                          "decode_tok_s_rounds": dec[v], "prefill_tok_s": max(pre[v]),
                          "prefill_tok_s_rounds": pre[v]}
  r = out["variants"]
  out["decode_after_over_before"] = r["kernel"]["decode_tok_s"] / r["xla"]["decode_tok_s"]
  out["prefill_after_over_before"] = r["kernel_last"]["prefill_tok_s"] / r["xla"]["prefill_tok_s"]
  return out


def main(_):
  if not cpu_kernel.available():
    raise SystemExit("bench_speed: the CPU kernel could not be built (see the message above)")
  bench_models.run_all({"decode_tokens": FLAGS.decode_tokens, "prompt_len": FLAGS.prompt_len,
                        "prefill_len": FLAGS.prefill_len, "rounds": FLAGS.rounds},
                       FLAGS.models, bench_model, FLAGS.out, table)


def table(res: dict) -> str:
  lines = [f"load average {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}; "
           f"tok/s, best of {res['rounds']} interleaved rounds",
           f"{'model':<11}{'variant':<13}{'decode':>9}{'prefill':>9}"]
  for name, m in res["models"].items():
    for v, r in m["variants"].items():
      d = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
      lines.append(f"{name:<11}{v:<13}{d:>9}{r['prefill_tok_s']:>9.1f}")
    lines.append(f"{name:<11}{'after/before':<13}{m['decode_after_over_before']:>8.2f}x"
                 f"{m['prefill_after_over_before']:>8.2f}x")
  return "\n".join(lines)
