"""Generate text with a MoE model from a local Hugging Face folder.

  python -m launch.generate --model_dir=ckpts/demo --prompt="def fib(n):" --max_new_tokens=64

`--temperature=0` is greedy.  Without a model folder (or with --random_model), a
small random-weight Qwen3-MoE is built on the spot and says so.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.loader import init_random, load_model
from moejax.sampler import Sampler, SamplingParams
from moejax.store import ExpertStore
from moejax.tokenizer import ByteTokenizer, Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "Folder with config.json, model.safetensors(.index.json), tokenizer.json.")
flags.DEFINE_bool("random_model", False, "Use a small random-weight model instead of --model_dir.")
flags.DEFINE_string("prompt", "def fibonacci(n):", "Prompt text.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute/parameter dtype.")
flags.DEFINE_integer("max_len", 1024, "KV cache length (prompt + new tokens).")
flags.DEFINE_string("policy", None, "Offload policy: a preset (quality, speed, baseline) or a "
                    "miss rule (fetch_all, threshold, first_choice, substitute_all, host). "
                    "Unset: every expert resident, no offloading.")
flags.DEFINE_float("cache_fraction", 0.25, "With --policy: share of each layer's experts resident.")
flags.DEFINE_integer("cache_bytes", None, "With --policy: expert cache budget in bytes over all "
                     "MoE layers (instead of --cache_fraction).")
flags.DEFINE_float("tau", None, "With --policy=threshold/quality: share at or above which a miss waits.")
flags.DEFINE_float("admission_beta", None, "With --policy: background admission threshold (> 0).")
flags.DEFINE_string("eviction", None, "With --policy: lru or lfu (default: the preset's).")
flags.DEFINE_string("link", "native", "With --policy: host->device link, 'native', 'scaled[:PROFILE]' "
                    "or e.g. '16GB/s,10us' (emulated).")


def random_demo_config() -> ModelConfig:
  return ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, num_experts=16, top_k=4,
                     moe_intermediate_size=16, intermediate_size=128,
                     sparse_layers=(True,) * 4, qk_norm="head").validate()


def load(dtype):
  """Returns (cfg, params, store, tokenizer, description)."""
  if FLAGS.random_model or not os.path.exists(os.path.join(FLAGS.model_dir, "config.json")):
    if not FLAGS.random_model:
      print(f"[moejax] no model at {FLAGS.model_dir!r}: using a small RANDOM-WEIGHT "
            "Qwen3-MoE built on the spot (its output is noise).", file=sys.stderr)
    cfg = random_demo_config()
    params, exps = init_random(cfg, seed=0, dtype=dtype)
    return cfg, params, ExpertStore.from_stacked(exps), ByteTokenizer(), "random-weight model"
  cfg, params, store = load_model(FLAGS.model_dir, dtype=dtype)
  tok_path = os.path.join(FLAGS.model_dir, "tokenizer.json")
  tok = Tokenizer(tok_path) if os.path.exists(tok_path) else ByteTokenizer()
  return cfg, params, store, tok, FLAGS.model_dir


def main(_):
  dtype = jnp.dtype(FLAGS.dtype)
  sp = SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                      max_new_tokens=FLAGS.max_new_tokens)
  cfg, params, store, tok, desc = load(dtype)
  sp = SamplingParams(sp.temperature, sp.top_p, sp.max_new_tokens, tuple(cfg.eos_token_ids))
  ids = tok.encode(FLAGS.prompt)
  if not ids:
    raise app.UsageError("--prompt encodes to no tokens")
  if FLAGS.policy is not None:
    return generate_offloaded(cfg, params, store, tok, desc, ids, sp, dtype)
  sampler = Sampler(cfg, params, store.to_device(dtype), max_len=FLAGS.max_len, dtype=dtype)
  print(f"[moejax] {desc}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_experts} experts "
        f"top-{cfg.top_k}, all experts resident", file=sys.stderr)
  t0 = time.time()
  out = sampler.generate(ids, sp, seed=FLAGS.seed)
  dt = time.time() - t0
  print(FLAGS.prompt + tok.decode(out))
  print(f"[moejax] {len(out)} tokens in {dt:.2f} s (incl. compile)", file=sys.stderr)


def generate_offloaded(cfg, params, store, tok, desc, ids, sp, dtype):
  """The OffloadEngine path: generates, then prints the per-token statistics table."""
  from moejax.offload.engine import OffloadEngine, format_stats
  from moejax.offload.link import LinkSpecError
  from moejax.offload.policy import PolicyError, make_policy
  from moejax.offload.resident import BudgetError
  try:
    policy = make_policy(FLAGS.policy, tau=FLAGS.tau, admission_beta=FLAGS.admission_beta,
                         eviction=FLAGS.eviction)
    eng = OffloadEngine(cfg, params, store, policy,
                        cache_fraction=None if FLAGS.cache_bytes else FLAGS.cache_fraction,
                        cache_bytes=FLAGS.cache_bytes,
                        link=FLAGS.link, max_len=FLAGS.max_len, dtype=dtype)
  except (PolicyError, BudgetError, LinkSpecError) as e:
    raise app.UsageError(str(e))
  with eng:
    print(f"[moejax] {desc}: {cfg.model_type}, {cfg.num_layers} layers; {eng.describe()}",
          file=sys.stderr)
    t0 = time.time()
    eng.warmup()
    print(f"[moejax] compiled in {time.time() - t0:.2f} s", file=sys.stderr)
    t0 = time.time()
    out = eng.generate(ids, sp, seed=FLAGS.seed)
    dt = time.time() - t0
    print(FLAGS.prompt + tok.decode(out))
    print(f"[moejax] {len(out)} tokens in {dt:.2f} s (prefill compiles); prompt: "
          f"{eng.prefill_record['fetches']:.0f} experts fetched", file=sys.stderr)
    print(format_stats(eng.stats(), eng.link.describe()), file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
