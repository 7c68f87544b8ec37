"""--model_dir=FILE.gguf: a GGUF file run in place, from the memory-mapped file.

The `gguf` package (PyPI, the `gguf` extra) reads the header and the tensor index
(`GGUFReader` maps the file); nothing is converted to another file.  Architectures:
`ARCHS` (llama.cpp's ``qwen3moe`` -> moejax's qwen3_moe).  Tensor types: F32, F16, BF16
(converted to the run's dtype as they are read) and Q8_0, Q4_0, Q4_K, Q6_K (kept as their
blocks: the dense linears become `QuantArray`s, the routed experts stay views of the mapped
file).  `inspect` refuses an unknown architecture or tensor type with one line naming it
(`GGUFUnsupported`, a usage error: exit 2) before any weight is read.

llama.cpp's converter (convert_hf_to_gguf.py) writes Qwen3-MoE without permuting q/k
(only its LLaMA-family classes permute for their interleaved RoPE; Qwen3's NEOX RoPE is the
HF halves layout moejax uses), so the tensors map one to one (`dense_path`), and stacks the
routed experts as ``blk.N.ffn_{gate,up,down}_exps.weight`` [E, I, D] / [E, D, I]: the store
keeps gate and up apart ({"gate@q4_k", "up@q4_k", "down@q6_k"}, `quantized.expert_key`) so
they stay in place; float experts are fused into "gate_up" in RAM.  Qwen3-MoE always
renormalises its top-k (llama.cpp hard-codes it): norm_topk_prob is True.

The tokenizer is a tokenizer.json beside the file (`tokenizer_path`) or, without one, the
file's tokenizer.ggml.* metadata (`gguf_tokenizer`; `moejax.io.tokenizer.Tokenizer` picks).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.ggml import types
from moejax.ggml.qarray import QuantArray
from moejax.io.safetensors_io import CheckpointError
from moejax.io.store import ExpertStore, LayerExperts, aligned_copy, stack_layers
from moejax.io.weights import quantized
from moejax.model.config import ModelConfig
from moejax.model.model import abstract_params, nest_params

ARCHS = {"qwen3moe": "qwen3_moe"}
FLOAT_TYPES = ("F32", "F16", "BF16")
READ_TYPES = FLOAT_TYPES + ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
_LAYER = {"attn_norm": ("input_layernorm", "weight"),
          "ffn_norm": ("post_attention_layernorm", "weight"),
          "attn_q": ("self_attn", "q_proj", "weight"), "attn_k": ("self_attn", "k_proj", "weight"),
          "attn_v": ("self_attn", "v_proj", "weight"),
          "attn_output": ("self_attn", "o_proj", "weight"),
          "attn_q_norm": ("self_attn", "q_norm", "weight"),
          "attn_k_norm": ("self_attn", "k_norm", "weight"),
          "ffn_gate_inp": ("mlp", "gate", "weight"), "ffn_gate": ("mlp", "gate_proj", "weight"),
          "ffn_up": ("mlp", "up_proj", "weight"), "ffn_down": ("mlp", "down_proj", "weight")}
_TOP = {"token_embd.weight": ("embed_tokens", "embedding"), "output_norm.weight": ("norm", "weight"),
        "output.weight": ("lm_head", "weight")}
_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


class GGUFUnsupported(ValueError):
  """A GGUF file of an architecture or tensor type moejax does not read (usage error)."""


def _reader(path: str):
  try:
    from gguf import GGUFReader
  except ImportError:
    raise GGUFUnsupported(f"--model_dir={path}: reading GGUF needs the gguf package "
                          f"(pip install 'moejax[gguf]')") from None
  try:
    return GGUFReader(path, "r")
  except ValueError as e:     # e.g. a tensor type number gguf-py does not know
    raise GGUFUnsupported(f"--model_dir={path}: not a GGUF file moejax can read ({e})") from None


def _meta(reader, key: str, default=None):
  f = reader.get_field(key)
  return default if f is None else f.contents()


def tensor_info(path: str):
  """(reader, arch) after the refusals: an unknown architecture or tensor type."""
  if not os.path.isfile(path):
    raise GGUFUnsupported(f"--model_dir={path}: no such GGUF file")
  reader = _reader(path)
  arch = _meta(reader, "general.architecture")
  if arch not in ARCHS:
    raise GGUFUnsupported(f"{path}: GGUF architecture '{arch}' is not one moejax runs "
                          f"(it runs {', '.join(ARCHS)})")
  for t in reader.tensors:
    if t.tensor_type.name not in READ_TYPES:
      raise GGUFUnsupported(f"{path}: tensor '{t.name}' has type {t.tensor_type.name}, which "
                            f"moejax does not read ({', '.join(READ_TYPES)})")
  return reader, arch


def read_config(reader, path: str) -> ModelConfig:
  """A ModelConfig from the GGUF's metadata (qwen3moe keys)."""
  a = _meta(reader, "general.architecture")
  get = lambda k, d=None: _meta(reader, f"{a}.{k}", d)
  names = {t.name: t for t in reader.tensors}
  need = lambda k: get(k) if get(k) is not None else _missing(path, f"{a}.{k}")
  n_layers, d = int(need("block_count")), int(need("embedding_length"))
  heads = int(need("attention.head_count"))
  eos = _meta(reader, "tokenizer.ggml.eos_token_id")
  bos = _meta(reader, "tokenizer.ggml.bos_token_id")
  return ModelConfig(
      model_type=ARCHS[a], vocab_size=int(names["token_embd.weight"].shape[1]), hidden_size=d,
      num_layers=n_layers, num_heads=heads,
      num_kv_heads=int(get("attention.head_count_kv", heads)),
      head_dim=int(get("attention.key_length", d // heads)),
      num_experts=int(need("expert_count")), top_k=int(need("expert_used_count")),
      moe_intermediate_size=int(need("expert_feed_forward_length")),
      intermediate_size=int(get("feed_forward_length", 0)),
      sparse_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(n_layers)),
      norm_topk_prob=True, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_theta=float(get("rope.freq_base", 10000.0)),
      max_position_embeddings=int(get("context_length", 4096)),
      tie_word_embeddings="output.weight" not in names, qk_norm="head",
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=() if eos is None else (int(eos),))


def _missing(path, key):
  raise CheckpointError(f"{path}: GGUF metadata '{key}' is missing")


def dense_path(name: str) -> tuple | None:
  """A GGUF tensor name -> the Flax parameter path (None: a routed expert tensor)."""
  if name in _TOP:
    return _TOP[name]
  m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
  if m and m.group(2) in _LAYER:
    return (f"layers_{m.group(1)}",) + _LAYER[m.group(2)]
  if m and m.group(2) in _EXPERTS:
    return None
  raise CheckpointError(f"tensor '{name}' is not one moejax maps for qwen3moe")


def _floats(t, dtype) -> np.ndarray:
  """A float tensor in numpy order [..., C] as `dtype` (BF16's bytes viewed as bf16)."""
  a = t.data
  if t.tensor_type.name == "BF16":
    a = a.view(ml_dtypes.bfloat16)
  return np.asarray(a).reshape(tuple(int(x) for x in reversed(t.shape))).astype(dtype)


def load_gguf(path: str, dtype=jnp.float32, mmap: bool = False, check_finite: bool = True):
  """(cfg, params, ExpertStore) of a GGUF file, as `loader.load_model` returns them."""
  reader, _ = tensor_info(path)
  cfg = read_config(reader, path)
  np_dtype = np.dtype(jnp.dtype(dtype))
  expected = {tuple(k.key for k in p): leaf for p, leaf in
              jax.tree_util.tree_flatten_with_path(abstract_params(cfg, dtype))[0]}
  leaves, experts = {}, {l: {} for l in cfg.moe_layers}
  for t in reader.tensors:
    p = dense_path(t.name)
    q = t.tensor_type.name.lower()
    shape = tuple(int(x) for x in reversed(t.shape))
    if p is None:
      layer, kind = int(t.name.split(".")[1]), _EXPERTS[t.name.split(".")[2]]
      experts[layer][quantized.expert_key(kind, q) if q in types.FORMATS else kind] = t
      continue
    if p not in expected or tuple(expected[p].shape) != shape:
      raise CheckpointError(f"{path}: tensor '{t.name}' has shape {shape}, expected "
                            f"{None if p not in expected else tuple(expected[p].shape)}")
    dt = np.dtype(expected[p].dtype)
    if q in types.FORMATS:
      leaves[p] = QuantArray(jnp.asarray(np.asarray(t.data)), q, dtype=dt)
    else:
      a = _floats(t, np.float32)
      if check_finite and not np.isfinite(a).all():
        raise CheckpointError(f"{path}: tensor '{t.name}' contains NaN or Inf")
      leaves[p] = jnp.asarray(a.astype(dt))
  missing = [p for p in expected if p not in leaves]
  if missing:
    raise CheckpointError(f"{path}: no tensor for parameter {'/'.join(missing[0])} "
                          f"({len(missing)} missing in all)")
  store = ExpertStore(_expert_layers(cfg, experts, np_dtype, mmap, path), cfg.num_layers,
                      backend="mmap" if mmap else "numpy")
  store.path = path
  return cfg, nest_params(leaves), store


def _expert_layers(cfg, experts: dict, np_dtype, mmap: bool, path: str) -> dict:
  per = {}
  for l, ts in experts.items():
    if sorted(quantized.split_key(k)[0] for k in ts) != ["down", "gate", "up"]:
      raise CheckpointError(f"{path}: layer {l} lacks routed expert tensors "
                            f"(has {sorted(ts)}; needs ffn_gate_exps, ffn_up_exps, ffn_down_exps)")
    if all("@" in k for k in ts):          # blocks: views of the mapped file
      per[l] = {k: t.data for k, t in ts.items()}
    else:                                  # floats: gate_up fused, as the run's dtype
      f = {quantized.split_key(k)[0]: _floats(t, np_dtype) if "@" not in k else None
           for k, t in ts.items()}
      if any(v is None for v in f.values()):
        raise CheckpointError(f"{path}: layer {l} mixes float and block expert tensors")
      per[l] = {"gate_up": np.concatenate([f["gate"], f["up"]], axis=1), "down": f["down"]}
  if not mmap:   # into RAM once, at jax's alignment (the map's offsets are the file's)
    st = stack_layers(per)
    per = st if st is not per else {l: {k: aligned_copy(v) for k, v in d.items()}
                                    for l, d in per.items()}
  return {l: LayerExperts(cfg.num_experts, stacked=d) for l, d in per.items()}


def nbytes(reader) -> tuple[int, int]:
  """(bytes of the dense tensors as the file holds them, bytes of one routed expert)."""
  dense = expert = 0
  for t in reader.tensors:
    if dense_path(t.name) is None:
      expert += int(t.n_bytes) // int(t.shape[2])     # ne2: the expert axis
    else:
      dense += int(t.n_bytes)
  layers = sum(1 for t in reader.tensors if t.name.endswith("ffn_down_exps.weight"))
  return dense, expert // max(layers, 1)


def tokenizer_path(path: str) -> str | None:
  """The tokenizer.json beside a GGUF file, if there is one."""
  p = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer.json")
  return p if os.path.exists(p) else None
