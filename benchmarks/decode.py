"""Decode/prefill throughput, all experts resident, side by side with transformers.

  python -m launch.bench_decode --out=bench_decode.json

Shape (random weights): Qwen3-MoE, 8 layers, hidden 512, 8 q / 4 kv heads x 64,
64 experts top-8, expert size 256, vocab 32000, f32, batch 1; a 64-token prompt
then 128 decoded tokens; prefill of a 512-token prompt.  The memory roofline is
(active weight bytes per decoded token) / (measured memory read bandwidth, the
best of a 2-thread numpy sum and an XLA matvec over 512 MB).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.config import ModelConfig
from moejax.io.loader import init_random, save_hf
from moejax.model.sampler import Sampler, SamplingParams
from moejax.kernels import cpu_kernel

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_decode.json", "JSON results file.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens before decoding.")
flags.DEFINE_integer("decode_tokens", 128, "Decoded tokens timed.")
flags.DEFINE_integer("prefill_len", 512, "Prompt length for the prefill measurement.")
flags.DEFINE_bool("transformers", True, "Also time transformers on the same weights.")
flags.DEFINE_integer("layers", 8, "Layers (smaller for a quick check).")
flags.DEFINE_integer("transformers_tokens", 32, "Decoded tokens timed for transformers (a rate).")


def bench_config() -> ModelConfig:
  return ModelConfig(model_type="qwen3_moe", vocab_size=32000, hidden_size=512,
                     num_layers=FLAGS.layers, num_heads=8, num_kv_heads=4, head_dim=64,
                     num_experts=64, top_k=8, moe_intermediate_size=256, intermediate_size=1024,
                     sparse_layers=(True,) * FLAGS.layers, norm_topk_prob=True,
                     qk_norm="head", max_position_embeddings=4096).validate()


def active_bytes_per_token(cfg: ModelConfig, itemsize: int = 4) -> int:
  d, hd = cfg.hidden_size, cfg.head_dim
  attn = d * hd * (cfg.num_heads * 2 + cfg.num_kv_heads * 2) + 2 * hd + 2 * d
  router = cfg.num_experts * d
  experts = cfg.top_k * 3 * d * cfg.moe_intermediate_size
  per_layer = attn + router + experts
  return itemsize * (cfg.num_layers * per_layer + d + d + cfg.vocab_size * d)


def read_bandwidth(nbytes: int = 512 << 20) -> dict:
  a = np.ones(nbytes // 4, np.float32)
  halves = np.array_split(a, 2)

  def two_thread_sum():
    out = [0.0, 0.0]
    def work(i):
      out[i] = float(halves[i].sum())
    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]

  def best(fn, n=5):
    fn()
    return min(_timed(fn) for _ in range(n))

  np_s = best(two_thread_sum)
  m = jnp.ones((nbytes // 4 // 4096, 4096), jnp.float32)
  v = jnp.ones((4096,), jnp.float32)
  mv = jax.jit(lambda m, v: m @ v)
  xla_s = best(lambda: mv(m, v).block_until_ready())
  return {"numpy_2thread_GBps": nbytes / np_s / 1e9, "xla_matvec_GBps": nbytes / xla_s / 1e9}


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def bench_moejax(cfg, params, experts) -> dict:
  s = Sampler(cfg, params, experts, max_len=FLAGS.prompt_len + FLAGS.decode_tokens + 8)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.vocab_size, (1, FLAGS.prompt_len)).astype(np.int32)
  sp = SamplingParams()
  key = jax.random.PRNGKey(0)

  def run(n):
    logits, cache = s.prefill(prompt)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    tok.block_until_ready()
    t = time.perf_counter()
    for i in range(n):
      tok, _, cache = s.decode_step(cache, tok, FLAGS.prompt_len + i, sp, key)
    tok.block_until_ready()
    return time.perf_counter() - t

  run(2)  # compile
  dec_s = min(run(FLAGS.decode_tokens) for _ in range(2))
  sp_pre = Sampler(cfg, params, experts, max_len=FLAGS.prefill_len + 8)
  long = rng.integers(0, cfg.vocab_size, (1, FLAGS.prefill_len)).astype(np.int32)
  sp_pre.prefill(long)[0].block_until_ready()
  pre_s = min(_timed(lambda: sp_pre.prefill(long)[0].block_until_ready()) for _ in range(3))
  return {"moejax_decode_tok_s": FLAGS.decode_tokens / dec_s,
          "moejax_prefill_tok_s": FLAGS.prefill_len / pre_s}


def bench_transformers(cfg, params, experts) -> dict:
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 2)
  with tempfile.TemporaryDirectory() as d:
    save_hf(cfg, params, experts, d, layout="per_expert")
    results = {}
    for impl in ("eager", "grouped_mm"):
      try:
        m = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="sdpa", experts_implementation=impl).eval()
      except Exception as e:  # an implementation missing in this version
        results[impl] = f"unavailable: {e}"[:200]
        continue
      prompt = torch.tensor(np.random.default_rng(0).integers(0, cfg.vocab_size,
                                                              (1, FLAGS.prompt_len)))
      with torch.inference_mode():
        def run(n):
          out = m(prompt, use_cache=True)
          past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
          t = time.perf_counter()
          for _ in range(n):
            out = m(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
          return time.perf_counter() - t
        run(2)
        n = FLAGS.transformers_tokens
        results[impl] = n / run(n)
      del m
  best = max((v for v in results.values() if isinstance(v, float)), default=float("nan"))
  return {"transformers_decode_tok_s": best, "transformers_by_impl": results}


def main(argv):
  with cpu_kernel.decoding():   # decode loops throughout: the kernel helpers stay awake
    return _main(argv)


def _main(_):
  cfg = bench_config()
  params, exps = init_random(cfg, seed=0)
  experts = [None if e is None else {k: jnp.array(v) for k, v in e.items()} for e in exps]
  res = {"shape": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": "8q/4kv x 64",
                   "experts": cfg.num_experts, "top_k": cfg.top_k,
                   "expert_size": cfg.moe_intermediate_size, "vocab": cfg.vocab_size,
                   "dtype": "float32", "batch": 1},
         "device": str(jax.devices()[0]), "cpu_count": os.cpu_count()}
  res.update(bench_moejax(cfg, params, experts))
  bw = read_bandwidth()
  res["bandwidth"] = bw
  res["active_bytes_per_token"] = active_bytes_per_token(cfg)
  best_bw = max(bw.values()) * 1e9
  res["roofline_tok_s"] = best_bw / res["active_bytes_per_token"]
  res["moejax_pct_of_roofline"] = 100 * res["moejax_decode_tok_s"] / res["roofline_tok_s"]
  if FLAGS.transformers:
    res.update(bench_transformers(cfg, params, exps))
    res["moejax_over_transformers"] = res["moejax_decode_tok_s"] / res["transformers_decode_tok_s"]
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  rows = [("moejax decode tok/s", res["moejax_decode_tok_s"]),
          ("transformers decode tok/s", res.get("transformers_decode_tok_s", float("nan"))),
          ("moejax / transformers", res.get("moejax_over_transformers", float("nan"))),
          ("memory roofline tok/s", res["roofline_tok_s"]),
          ("moejax % of roofline", res["moejax_pct_of_roofline"]),
          (f"moejax prefill tok/s ({FLAGS.prefill_len})", res["moejax_prefill_tok_s"]),
          ("read bandwidth GB/s (best)", max(bw.values()))]
  w = max(len(r[0]) for r in rows)
  print("\n".join(f"{k:<{w}}  {v:10.2f}" for k, v in rows))
  print(f"wrote {FLAGS.out}")
