"""The models that the speed benchmarks (bench_speed, bench_peers) time.

  bench   Qwen3-MoE, 8 layers, hidden 512, 8 q / 4 kv heads x 64, 64 experts of 256,
          top-8, vocab 32000, random weights (seed 0), saved to a HF folder on request
  demo    the demo checkpoint (ckpts/demo), converted to the requested dtype
  wide    Qwen3-30B-A3B's layer width (hidden 2048, 32 q / 4 kv heads x 128, 128 experts
          of 768, top-8, norm_topk_prob), 4 layers by default, vocab 8192, random bf16
          weights (std 0.02) whose routers route like a trained model's (benchmarks/
          routing.py: an LRU of 25% hits about 0.8 on held-out text, the load balanced),
          stored per expert as the published checkpoints are, in 5 safetensors shards:
          `save_wide` writes it once (5.05 GB at 4 layers, 30 GB at 24)
  wide_q8_0, wide_q4_0, wide_q4_k_m
          the same wide model as one GGUF file that both engines read (`wide_gguf`): the
          bf16 GGUF (llama.cpp's converter, once) requantized by llama.cpp's
          llama_model_quantize, once (benchmarks/llama_cpp.quantize).  q8_0 and q4_0 are
          llama-quantize --pure: every linear in that format (routed experts, attention,
          LM head, embeddings); q4_k_m is llama-quantize's default Q4_K_M mix (Q6_K for the
          output and some attn_v / ffn_down).  Norms and routers keep their f32.  moejax
          runs the file in place (`load_model(FILE.gguf)`, experts in the mapped file), with
          the tokenizer.json copied beside it.  4 layers: 2.7 / 1.5 / 1.6 GB
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import routing, stream
from moejax.model.config import ModelConfig
from moejax.io.loader import init_random, load_model, save_hf
from moejax.io.store import ExpertStore
from moejax.kernels import cpu_kernel

DEMO_DIR = "ckpts/demo"
NAMES = ("bench_f32", "bench_bf16", "demo_f32", "demo_bf16", "wide_bf16", "wide_q8_0",
         "wide_q4_0", "wide_q4_k_m")
# the GGUF formats of the wide model: llama-quantize's --pure or not (module docstring)
GGUF_FORMATS = {"q8_0": True, "q4_0": True, "q4_k_m": False}
WIDE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "models")


def run_all(res: dict, names, bench_model, out: str, table) -> dict:
  """res["models"][name] = bench_model(name) for each name, with the device, core count
  and load average before and after; res is written to `out` after every model (a long
  run keeps what it measured); prints `table(res)`."""
  res = {"device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
         "cpu_kernels": cpu_kernel.describe(), "loadavg_start": os.getloadavg(), **res,
         "models": {}}
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


def demo_shape(layers: int) -> ModelConfig:
  """The demo model's shape (bench_offload's random-weight model) with `layers` (0: 8)."""
  return ModelConfig(model_type="qwen3_moe", vocab_size=8192, hidden_size=128,
                     num_layers=layers or 8, num_heads=4, num_kv_heads=2, head_dim=32,
                     num_experts=64, top_k=8, moe_intermediate_size=32, intermediate_size=512,
                     sparse_layers=(True,) * (layers or 8), qk_norm="head",
                     norm_topk_prob=True).validate()


def qwen3_30b_shape(layers: int) -> ModelConfig:
  """wide_bf16's layers (Qwen3-30B-A3B's width) with the real vocabulary of 151,936."""
  return dataclasses.replace(wide_config(layers or 4), vocab_size=151936).validate()


GGUF_DIR = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "gguf")   # bench_scale's too


def split_name(name: str) -> tuple[str, jnp.dtype]:
  """(kind, compute dtype): a GGUF format computes in bf16."""
  kind, dt = name.split("_", 1) if name in NAMES else ("", "")
  if not kind:
    raise ValueError(f"--models: unknown model {name!r}; choose from {', '.join(NAMES)}")
  return kind, jnp.dtype(jnp.float32 if dt == "f32" else jnp.bfloat16)


def weights_of(name: str) -> str:
  """The weights' format of a benchmark model: "f32", "bf16", or a GGUF_FORMATS key."""
  split_name(name)
  return name.split("_", 1)[1]


def wide_gguf_path(layers: int, fmt: str, root: str = WIDE_DIR, layout: str = "per_expert",
                   gguf_dir: str = GGUF_DIR) -> str:
  """Where `wide_gguf` keeps the wide model's GGUF in `fmt` (nothing is made)."""
  if fmt != "bf16" and fmt not in GGUF_FORMATS:
    raise ValueError(f"wide_gguf: format {fmt!r}; choose from bf16, {', '.join(GGUF_FORMATS)}")
  stem = os.path.basename(os.path.normpath(wide_dir(layers, root, layout)))
  return (os.path.join(gguf_dir, f"{stem}-bf16.gguf") if fmt == "bf16" else
          os.path.join(gguf_dir, f"{stem}-{fmt}", f"{stem}-{fmt}.gguf"))


def wide_gguf(layers: int, fmt: str, root: str = WIDE_DIR, layout: str = "per_expert",
              gguf_dir: str = GGUF_DIR, cache: str | None = None) -> str:
  """The wide model of `layers` layers as one GGUF in `fmt` ("bf16" or a GGUF_FORMATS key),
  made once: the safetensors (`save_wide`), llama.cpp's bf16 conversion beside the others
  in `gguf_dir`, then (a GGUF_FORMATS key) its requantization into a folder of its own,
  gguf_dir/<model>-<fmt>/<model>-<fmt>.gguf, with the tokenizer.json beside it (moejax's
  loader reads it there).  Each step is skipped when its file exists; llama.cpp is built
  only when a file is missing (benchmarks/llama_cpp.py; Unavailable when it cannot be)."""
  from benchmarks import llama_cpp
  cache = cache or llama_cpp.DEFAULT_CACHE
  d = wide_dir(layers, root, layout)
  src = wide_gguf_path(layers, "bf16", root, layout, gguf_dir)
  out = wide_gguf_path(layers, fmt, root, layout, gguf_dir)
  if not os.path.exists(out):
    if not os.path.exists(src):
      save_wide(d, layers, layout=layout)
      llama_cpp.build(cache)
      assert llama_cpp.convert(cache, d, "bf16", gguf_dir) == src, src
    os.makedirs(os.path.dirname(out), exist_ok=True)
    llama_cpp.quantize(cache, src, fmt, out, pure=GGUF_FORMATS[fmt])
  tok = os.path.join(os.path.dirname(out), "tokenizer.json")
  if fmt != "bf16" and not os.path.exists(tok):
    import shutil
    shutil.copy(os.path.join(d, "tokenizer.json"), tok)
  return out


def load(name: str, demo_dir: str = DEMO_DIR):
  """(cfg, params, ExpertStore on the host, HF folder or None, tokenizer.json or None).
  A wide GGUF model (wide_q8_0, ...) runs from its GGUF (`wide_gguf`); its HF folder is the
  bf16 safetensors that the GGUF was made from.

  The bench shape has no folder of its own (``save_bench`` writes one)."""
  kind, dtype = split_name(name)
  if kind == "demo":
    if not os.path.exists(os.path.join(demo_dir, "config.json")):
      raise FileNotFoundError(f"no demo model at {demo_dir} (set --demo_dir)")
    cfg, params, store = load_model(demo_dir, dtype=dtype)
    tok = os.path.join(demo_dir, "tokenizer.json")
    return cfg, params, store, demo_dir, tok if os.path.exists(tok) else None
  if kind == "wide" and weights_of(name) in GGUF_FORMATS:   # the GGUF file, in place
    g = wide_gguf(4, weights_of(name))
    cfg, params, store = load_model(g, dtype=dtype, mmap=True)
    return cfg, params, store, wide_dir(4), os.path.join(os.path.dirname(g), "tokenizer.json")
  if kind == "wide":   # real width: written once, mapped (--store=mmap), read in place
    d = save_wide(wide_dir(4))
    cfg, params, store = load_model(d, dtype=dtype, mmap=True)
    return cfg, params, store, d, os.path.join(d, "tokenizer.json")
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


def wide_config(layers: int = 4) -> ModelConfig:
  """Qwen3-30B-A3B's layer width with `layers` layers and a vocabulary of 8192."""
  return ModelConfig(model_type="qwen3_moe", vocab_size=8192, hidden_size=2048,
                     num_layers=layers, num_heads=32, num_kv_heads=4, head_dim=128,
                     num_experts=128, top_k=8, moe_intermediate_size=768,
                     intermediate_size=6144, sparse_layers=(True,) * layers, qk_norm="head",
                     norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=4096,
                     bos_token_id=None).validate()


def wide_dir(layers: int = 4, root: str = WIDE_DIR, layout: str = "per_expert") -> str:
  return os.path.join(root, f"wide_bf16_{layers}L_routed" + ("" if layout == "per_expert"
                                                             else f"_{layout}"))


def routed_design(cfg: ModelConfig, demo_dir: str = DEMO_DIR, seed: int = 0):
  """The routers' design of a benchmark model of `cfg`'s shape (benchmarks/routing.py),
  calibrated on the train split as the demo tokenizer encodes it."""
  tok = os.path.join(demo_dir, "tokenizer.json")
  return routing.design(cfg, stream.calibration_ids(tok),
                        stream.calibration_ids(tok, 65536, stride=7, per_doc=0), seed=seed)


def wide_bytes(layers: int, weights: str = "bf16") -> int:
  """The wide model's size on disk: bf16 (either layout), or in a pure block format
  ("q8_0", "q4_0": every linear in it, norms and routers in bf16, as moejax's --weights
  counts them; a pure GGUF keeps its norms and routers in f32, 0.3% more at 24 layers)."""
  import numpy as np
  from moejax.io.loader import abstract_params
  from moejax.io.weights import quantized
  from moejax.offload.memory import expert_nbytes, tree_nbytes
  cfg = wide_config(layers)
  params = abstract_params(cfg, jnp.bfloat16)
  if weights == "bf16":
    return (tree_nbytes(params)
            + layers * cfg.num_experts * expert_nbytes(cfg, np.dtype("bfloat16")))
  if not GGUF_FORMATS.get(weights):
    raise ValueError(f"wide_bytes: weights {weights!r}; choose from bf16, q8_0, q4_0")
  return (quantized.dense_nbytes(params, weights, jnp.bfloat16)
          + layers * cfg.num_experts * quantized.expert_nbytes(cfg, weights))


def save_wide(out_dir: str, layers: int = 4, shards: int = 5, seed: int = 0,
              demo_dir: str = DEMO_DIR, progress: bool | None = None,
              layout: str = "per_expert", cfg: ModelConfig | None = None) -> str:
  """Writes the wide model (module docstring) to `out_dir` once, streaming: one expert's
  tensors in memory at a time.  Shard 1 holds the dense tensors, shards 2.. the experts
  of consecutive layers.  layout "fused": each layer's experts as the transformers-v5
  stacked ``mlp.experts.gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I] (random
  values of the same distribution), which `--store=mmap` maps without a repack.  Every tensor starts on a 64-byte
  boundary with no gaps (the header is padded; every tensor's size is a multiple of 64).
  Refuses before writing when the disk lacks the space."""
  import shutil
  import sys
  import ml_dtypes
  import numpy as np
  from tqdm import tqdm
  from moejax.io.loader import abstract_params
  from moejax.io.safetensors_io import write_streamed
  if os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")):
    return out_dir
  cfg = cfg or wide_config(layers)
  layers = cfg.num_layers
  bf16 = np.dtype(ml_dtypes.bfloat16)
  dense = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg, jnp.bfloat16))[0]:
    p = [k.key for k in path]
    name = ("model.embed_tokens.weight" if p == ["embed_tokens", "embedding"] else
            "lm_head.weight" if p[0] == "lm_head" else
            "model." + ".".join(p).replace("layers_", "layers."))
    dense.append((name, bf16, tuple(leaf.shape)))
  i_, d_ = cfg.moe_intermediate_size, cfg.hidden_size
  shapes = {"gate_proj": (i_, d_), "up_proj": (i_, d_), "down_proj": (d_, i_)}
  groups = np.array_split(np.arange(layers), max(1, min(shards - 1, layers)))
  files = [[(n, dt, s) for n, dt, s in dense]]
  E = cfg.num_experts
  for g in groups:
    if layout == "fused":
      files.append([(f"model.layers.{l}.mlp.experts.{w}", bf16, (E,) + s)
                    for l in g for w, s in (("gate_up_proj", (2 * i_, d_)),
                                            ("down_proj", (d_, i_)))])
    else:
      files.append([(f"model.layers.{l}.mlp.experts.{e}.{w}.weight", bf16, shapes[w])
                    for l in g for e in range(E) for w in shapes])
  total = sum(int(np.prod(s)) * 2 for f in files for _, _, s in f)
  os.makedirs(out_dir, exist_ok=True)
  free = shutil.disk_usage(out_dir).free
  if free < total * 1.02:
    raise OSError(f"{out_dir}: the wide model needs {total / 1e9:.2f} GB, the disk has "
                  f"{free / 1e9:.2f} GB free")
  rng = np.random.default_rng(seed)

  shape_of = {n: s for f in files for n, _, s in f}
  design = routed_design(cfg, demo_dir)

  def chunks(name):
    shape = shape_of[name]
    std = 0.0 if name.endswith("norm.weight") else 0.02
    rows = max(1, (1 << 22) // int(np.prod(shape[1:])))   # ~4M values at a time
    for r in range(0, shape[0], rows):
      n = min(rows, shape[0] - r)
      arr = (np.ones((n,) + shape[1:], np.float32) if std == 0.0 else
             rng.standard_normal((n,) + shape[1:], dtype=np.float32) * std)
      yield routing.fix(design, name, r, arr).astype(bf16)

  bar = tqdm(total=total, desc=f"writing {out_dir}", unit="B", unit_scale=True,
             unit_divisor=1000, file=sys.stderr,
             disable=not (sys.stderr.isatty() if progress is None else progress))
  weight_map = {}
  for k, specs in enumerate(files):
    fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
    write_streamed(os.path.join(out_dir, fname), specs, chunks, {"format": "pt"},
                   align=64, on_bytes=bar.update)
    weight_map.update({n: fname for n, _, _ in specs})
  bar.close()
  hf = cfg.to_hf_dict()
  hf["torch_dtype"] = "bfloat16"
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  tok = os.path.join(demo_dir, "tokenizer.json")
  if os.path.exists(tok):
    shutil.copy(tok, os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:   # last: done
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  return out_dir
