"""The models that the speed benchmarks (bench_speed, bench_peers) time.

  bench   Qwen3-MoE, 8 layers, hidden 512, 8 q / 4 kv heads x 64, 64 experts of 256,
          top-8, vocab 32000, random weights (seed 0), saved to a HF folder on request
  demo    the demo checkpoint (ckpts/demo), converted to the requested dtype
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from moejax.model.config import ModelConfig
from moejax.io.loader import init_random, load_model, save_hf
from moejax.io.store import ExpertStore

DEMO_DIR = "ckpts/demo"
NAMES = ("bench_f32", "bench_bf16", "demo_f32", "demo_bf16")


def run_all(res: dict, names, bench_model, out: str, table) -> dict:
  """res["models"][name] = bench_model(name) for each name, with the device, core count
  and load average before and after; res is written to `out` after every model (a long
  run keeps what it measured); prints `table(res)`."""
  res = {"device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
         "loadavg_start": os.getloadavg(), **res, "models": {}}
  for name in names:
    res["models"][name] = bench_model(name)
    res["loadavg_end"] = os.getloadavg()
    with open(out, "w") as f:
      json.dump(res, f, indent=2)
  print(table(res))
  print(f"wrote {out}")
  return res


def bench_config(layers: int = 8) -> ModelConfig:
  return ModelConfig(model_type="qwen3_moe", vocab_size=32000, hidden_size=512,
                     num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=64,
                     num_experts=64, top_k=8, moe_intermediate_size=256, intermediate_size=1024,
                     sparse_layers=(True,) * layers, norm_topk_prob=True,
                     qk_norm="head", max_position_embeddings=4096).validate()


def split_name(name: str) -> tuple[str, jnp.dtype]:
  if name not in NAMES:
    raise ValueError(f"--models: unknown model {name!r}; choose from {', '.join(NAMES)}")
  kind, dt = name.split("_")
  return kind, jnp.dtype({"f32": jnp.float32, "bf16": jnp.bfloat16}[dt])


def load(name: str, demo_dir: str = DEMO_DIR):
  """(cfg, params, ExpertStore on the host, HF folder or None, tokenizer.json or None).

  The bench shape has no folder of its own (``save_bench`` writes one)."""
  kind, dtype = split_name(name)
  if kind == "demo":
    if not os.path.exists(os.path.join(demo_dir, "config.json")):
      raise FileNotFoundError(f"no demo model at {demo_dir} (set --demo_dir)")
    cfg, params, store = load_model(demo_dir, dtype=dtype)
    tok = os.path.join(demo_dir, "tokenizer.json")
    return cfg, params, store, demo_dir, tok if os.path.exists(tok) else None
  cfg = bench_config()
  params, exps = init_random(cfg, seed=0, dtype=dtype)
  return cfg, params, ExpertStore.from_stacked(exps), None, None


def save_bench(out_dir: str, demo_dir: str = DEMO_DIR) -> str:
  """The bench shape's random f32 weights as a HF folder (what transformers and the GGUF
  converter read), written once, with the demo model's tokenizer (the converter needs
  one; it pads the vocabulary to 32000 entries)."""
  if not os.path.exists(os.path.join(out_dir, "config.json")):
    cfg = bench_config()
    params, exps = init_random(cfg, seed=0, dtype=jnp.float32)
    tok = os.path.join(demo_dir, "tokenizer.json")
    save_hf(cfg, params, exps, out_dir, layout="per_expert",
            tokenizer_json=tok if os.path.exists(tok) else None)
  return out_dir
