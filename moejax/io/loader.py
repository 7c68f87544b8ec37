"""One loader for every checkpoint source: a local Hugging Face folder.

``load_model(dir)`` reads ``config.json`` and ``model.safetensors`` (or the
sharded ``model.safetensors.index.json``), accepts the per-expert hub layout and
the fused transformers-v5 layout, puts dense parameters on the device and
routed experts into a host-side ExpertStore.  Errors name the file and tensor.
While it reads, a progress bar on stderr counts the checkpoint's bytes (``progress``:
by default only when stderr is a terminal).
"""

from __future__ import annotations

import json
import os
import re
import sys
import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import families
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer, abstract_params, nest_params
from moejax.ggml.qarray import QuantArray
from moejax.io import expert_layout
from moejax.io import repack
from moejax.io.weights import gguf_file
from moejax.io.weights import quantized
from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, save_file
from moejax.io.store import ExpertStore, LayerExperts, stack_layers


def checkpoint_dtype(model_dir: str | None) -> str | None:
  """The dtype config.json says the weights are stored in (torch_dtype / dtype), if any."""
  if model_dir is None:
    return None
  try:
    with open(os.path.join(model_dir, "config.json")) as f:
      hf = json.load(f)
  except (OSError, ValueError):
    return None
  name = hf.get("torch_dtype") or hf.get("dtype")
  return name if name in ("float32", "bfloat16", "float16") else None


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Per-expert tensor shapes of the (dequantised) expert dict, without the expert axis."""
  return families.of(cfg).expert_shapes(cfg)


def check_checkpoint(model_dir: str, cfg, dtype):
  """`repack.check_space` for a checkpoint folder before loading it with mmap=True: a repack is
  needed for per-expert tensors or a stored dtype other than `dtype` (read from the
  index or header and config.json only)."""
  shp = expert_shapes(cfg)
  if set(shp) != {"gate_up", "down"}:
    return                                  # a family's own layout is not repacked
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      names = list(json.load(f).get("weight_map", {}))
  elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
    names = list(SafetensorsFile(os.path.join(model_dir, "model.safetensors")).keys())
  else:
    return
  stored = checkpoint_dtype(model_dir)
  per_expert = (any(".mlp.experts.0." in n for n in names)
                or (stored is not None and stored != np.dtype(dtype).name))
  repack.check_space(model_dir, cfg.moe_layers, cfg.num_experts, shp, dtype, per_expert)


def init_random(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.02):
  """A random-weight model: (params, per-layer expert weight dicts as numpy)."""
  model = Transformer(cfg, dtype)
  rng = np.random.default_rng(seed)
  exps = []
  for s in cfg.sparse_layers:
    if not s:
      exps.append(None)
      continue
    exps.append({k: (rng.standard_normal((cfg.num_experts,) + v, dtype=np.float32) * scale
                     ).astype(jnp.dtype(dtype)) for k, v in expert_shapes(cfg).items()})
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32),
                      [None if e is None else {k: jnp.asarray(v) for k, v in e.items()}
                       for e in exps])["params"]
  return params, exps


# --------------------------------------------------------------------- names
def _split(name: str):
  """HF tensor name (after `Family.rename_tensor`) -> ("dense", path tuple) |
  ("expert", layer, expert|None, kind)."""
  n = name[len("model."):] if name.startswith("model.") else name
  m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", n)
  if m:
    return ("expert", int(m.group(1)), int(m.group(2)), m.group(3))
  m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.((?:gate_up|down)_proj(?:_bias|_blocks|_scales)?)", n)
  if m:
    return ("expert", int(m.group(1)), None, m.group(2))
  m = re.fullmatch(r"layers\.(\d+)\.(.+)", n)
  if m:
    return ("dense", (f"layers_{m.group(1)}",) + tuple(m.group(2).split(".")))
  if n == "embed_tokens.weight":
    return ("dense", ("embed_tokens", "embedding"))
  return ("dense", tuple(n.split(".")))


class _Index:
  """tensor name -> SafetensorsFile, over one file or a sharded index."""

  def __init__(self, model_dir: str):
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    self.files: dict[str, SafetensorsFile] = {}
    self.where: dict[str, str] = {}
    if os.path.exists(index):
      try:
        with open(index) as f:
          wm = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
      for shard in sorted(set(wm.values())):
        p = os.path.join(model_dir, shard)
        if not os.path.exists(p):
          raise CheckpointError(f"{p}: shard listed in {index} is missing")
        self.files[p] = SafetensorsFile(p)
      for t, shard in wm.items():
        p = os.path.join(model_dir, shard)
        if t not in self.files[p].header:
          raise CheckpointError(f"{p}: tensor '{t}' listed in the index is not in the shard")
        self.where[t] = p
    elif os.path.exists(single):
      f = SafetensorsFile(single)
      self.files[single] = f
      self.where = {t: single for t in f.keys()}
    else:
      raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")

    self.bar = None                       # a tqdm bar counting bytes read (`track`)
    self._counted: set[str] = set()

  def nbytes(self, name: str) -> int:
    lo, hi = self.files[self.where[name]].header[name]["data_offsets"]
    return hi - lo

  def track(self, enabled: bool | None, desc: str):
    """A progress bar over the bytes of every tensor (each counted when first read);
    `enabled` None: only when stderr is a terminal."""
    if enabled is None:
      enabled = sys.stderr.isatty()
    if not enabled:
      return
    from tqdm import tqdm
    total = sum(self.nbytes(t) for t in self.where)
    self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                    file=sys.stderr, leave=False, mininterval=0.25, dynamic_ncols=True)

  def skip(self, name: str):
    """A tensor the model does not use (it counts as done)."""
    if self.bar is not None and name not in self._counted:
      self._counted.add(name)
      self.bar.update(self.nbytes(name))

  def close(self, complete: bool = False):
    if self.bar is not None:
      if complete:                 # e.g. experts left on disk (mmap), read on demand
        self.bar.update(self.bar.total - self.bar.n)
      self.bar.close()
      self.bar = None

  def get(self, name: str) -> np.ndarray:
    self.skip(name)
    return self.files[self.where[name]].get(name)

  def dtype(self, name: str) -> str:
    return self.files[self.where[name]].header[name]["dtype"]


def load_model(model_dir: str, dtype=jnp.float32, mmap: bool = False, check_finite: bool = True,
               dequantize_mxfp4: bool = False, progress: bool | None = None,
               weights: str = "float"):
  """Returns (cfg, params on device, ExpertStore on host).

  ``weights``: "float" (the checkpoint's floats, as `dtype`), or a block format of
  moejax.ggml ("q8_0", "q4_0", "q4_k", "q6_k"): the linears and routed experts are
  quantized once into the cache folder (`io.weights.quantized`), the params' linears are
  QuantArrays and the store's experts their blocks.  ``model_dir`` may be a ``.gguf``
  file (`io.weights.gguf_file`: read in place; ``weights`` must then be "float").

  A family's own expert layout is read by its ``load_layer_experts``; MXFP4 experts
  (gpt_oss ``*_blocks``/``*_scales``) stay MXFP4 in the store (a fetch
  moves the 4-bit bytes; the device dequantises) unless ``dequantize_mxfp4``.
  ``progress``: a tqdm bar on stderr over the checkpoint's bytes while reading; None
  (default): only when stderr is a terminal; False: never.
  """
  quantized.check_weights(weights)
  if model_dir.endswith(".gguf"):
    if weights != "float":
      raise quantized.WeightsError(f"{model_dir}: a GGUF file runs in its own formats; "
                                   f"--weights={weights} applies to a safetensors folder")
    return gguf_file.load_gguf(model_dir, dtype, mmap, check_finite)
  cfg = ModelConfig.from_json_file(model_dir)
  family = families.of(cfg)
  idx = _Index(model_dir)
  idx.track(progress, f"loading {os.path.basename(os.path.normpath(model_dir))}")
  try:
    if weights != "float":
      out = _load_quantized(cfg, family, idx, model_dir, dtype, mmap, check_finite, weights,
                            progress)
      idx.close(complete=True)
      return out
    out = _load(cfg, family, idx, model_dir, dtype, mmap, check_finite, dequantize_mxfp4,
                progress)
    idx.close(complete=True)
    return out
  finally:
    idx.close()


def _tensors(cfg, family, idx: _Index, model_dir, dtype):
  """The checkpoint's tensors sorted out: (dense {Flax path: name}, per_expert, fused,
  {Flax path: expected shape}, {Flax path: dtype}); a CheckpointError names a missing
  dense tensor or a misplaced expert."""
  expected = abstract_params(cfg, dtype)
  leaf_dtypes = {tuple(k.key for k in path): np.dtype(leaf.dtype)
                 for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]}
  flat_expected = {tuple(k.key for k in path): leaf.shape
                   for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]}

  dense: dict[tuple, np.ndarray] = {}
  per_expert: dict[int, dict[int, dict[str, str]]] = {}
  fused: dict[int, dict[str, str]] = {}
  for name in idx.where:
    kind = _split(family.rename_tensor(name))
    if kind[0] == "dense":
      if kind[1] in flat_expected:
        dense[kind[1]] = name
      else:
        idx.skip(name)  # e.g. rotary inv_freq buffers: not parameters
      continue
    _, layer, e, what = kind
    if cfg.num_layers <= layer < cfg.num_layers + cfg.family_config.hub_extra_layers:
      idx.skip(name)
      continue  # multi-token-prediction layers (glm4_moe, deepseek_v3): not part of decoding
    if layer >= cfg.num_layers or not cfg.sparse_layers[layer]:
      raise CheckpointError(f"{idx.where[name]}: tensor '{name}' is a routed expert of layer "
                            f"{layer}, which config.json does not make sparse")
    if e is None:
      fused.setdefault(layer, {})[what] = name
    else:
      if e >= cfg.num_experts:
        raise CheckpointError(f"{idx.where[name]}: tensor '{name}' names expert {e}, but "
                              f"config.json has {cfg.num_experts} experts")
      per_expert.setdefault(layer, {}).setdefault(e, {})[what] = name

  # dense parameters
  missing = [p for p in flat_expected if p not in dense]
  if missing:
    p = missing[0]
    hf = "model." + ".".join(p).replace("layers_", "layers.").replace("embed_tokens.embedding",
                                                                        "embed_tokens.weight")
    if p[0] == "lm_head":
      hf = "lm_head.weight"
    raise CheckpointError(f"{model_dir}: missing tensor '{hf}' ({len(missing)} missing in all)")
  return dense, per_expert, fused, flat_expected, leaf_dtypes


def _load(cfg, family, idx: _Index, model_dir, dtype, mmap, check_finite, dequantize_mxfp4,
          progress=None):
  np_dtype = np.dtype(jnp.dtype(dtype))
  dense, per_expert, fused, flat_expected, leaf_dtypes = _tensors(cfg, family, idx,
                                                                  model_dir, dtype)
  leaves = {}
  for p, name in dense.items():
    a = idx.get(name)
    expert_layout.check(idx, name, a, flat_expected[p], check_finite)
    # a module may keep a parameter in f32 whatever `dtype` (e.g. sigmoid routers, like HF)
    leaves[p] = jnp.asarray(np.asarray(a).astype(leaf_dtypes.get(p, np_dtype)))
  params = nest_params(leaves)

  # routed experts
  if family.load_layer_experts is not None:    # the family's own tensor layout
    layers = {layer: LayerExperts(cfg.num_experts, stacked=family.load_layer_experts(
        idx, fused.get(layer, {}), cfg, layer, np_dtype, dequantize_mxfp4=dequantize_mxfp4,
        mmap=mmap, check_finite=check_finite, check=expert_layout.check, error=CheckpointError,
        model_dir=model_dir)) for layer in cfg.moe_layers}
  elif mmap:
    layers = expert_layout.mapped_experts(cfg, idx, model_dir, fused, per_expert, np_dtype,
                                          check_finite, progress)
  else:
    layers = expert_layout.ram_experts(cfg, idx, model_dir, fused, per_expert, np_dtype,
                                       check_finite)
  return cfg, params, ExpertStore(layers, cfg.num_layers, backend="mmap" if mmap else "numpy")


def _load_quantized(cfg, family, idx: _Index, model_dir, dtype, mmap, check_finite, qtype,
                    progress=None):
  """`load_model` with weights=qtype: the repacked file (`quantized.build`), mapped."""
  if family.load_layer_experts is not None or set(expert_shapes(cfg)) != {"gate_up", "down"}:
    raise quantized.WeightsError(f"--weights={qtype}: {cfg.model_type}'s routed experts have "
                                 f"their own layout; quantized weights need SwiGLU experts "
                                 f"(gate_up, down)")
  dense, per_expert, fused, shapes, leaf_dtypes = _tensors(cfg, family, idx, model_dir, dtype)
  for p, name in dense.items():          # dtype and shape from the headers (no read)
    expert_layout.check(idx, name, idx.files[idx.where[name]].get(name), shapes[p], False)
  path = quantized.build(cfg, idx, model_dir, dense, shapes, fused, per_expert, qtype,
                         check_finite, progress)
  arrays, experts = quantized.open_weights(path, cfg.moe_layers)
  np_dtype = np.dtype(jnp.dtype(dtype))
  leaves = {}
  for p, (a, q) in arrays.items():
    dt = leaf_dtypes.get(p, np_dtype)
    leaves[p] = (QuantArray(jnp.asarray(np.asarray(a)), q, dtype=dt) if q
                 else jnp.asarray(np.asarray(a).astype(dt)))
  if not mmap:                            # into RAM: one [L, E, ...] array per kind
    experts = stack_layers({l: {k: np.array(v) for k, v in d.items()}
                            for l, d in experts.items()})
  layers = {l: LayerExperts(cfg.num_experts, stacked=d) for l, d in experts.items()}
  store = ExpertStore(layers, cfg.num_layers, backend="mmap" if mmap else "numpy")
  store.weights = qtype
  return cfg, nest_params(leaves), store


def save_hf(cfg: ModelConfig, params, experts: list, out_dir: str, dtype=np.float32,
            layout: str = "per_expert", tokenizer_json: str | None = None):
  """Write a HF-format folder (config.json + model.safetensors) for a qwen3_moe model."""
  os.makedirs(out_dir, exist_ok=True)
  t: dict[str, np.ndarray] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    p = [k.key for k in path]
    if p == ["embed_tokens", "embedding"]:
      name = "model.embed_tokens.weight"
    elif p[0] == "lm_head":
      name = "lm_head.weight"
    else:
      name = "model." + ".".join(p).replace("layers_", "layers.")
    t[name] = np.asarray(jnp.asarray(leaf, jnp.float32)).astype(dtype)
  for i, e in enumerate(experts):
    if e is None:
      continue
    gu = np.asarray(jnp.asarray(e["gate_up"], jnp.float32)).astype(dtype)
    dn = np.asarray(jnp.asarray(e["down"], jnp.float32)).astype(dtype)
    if layout == "fused":
      t[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gu
      t[f"model.layers.{i}.mlp.experts.down_proj"] = dn
    else:
      half = gu.shape[1] // 2
      for j in range(gu.shape[0]):
        pre = f"model.layers.{i}.mlp.experts.{j}."
        t[pre + "gate_proj.weight"] = gu[j, :half]
        t[pre + "up_proj.weight"] = gu[j, half:]
        t[pre + "down_proj.weight"] = dn[j]
  save_file(t, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
  hf = cfg.to_hf_dict()
  hf["torch_dtype"] = "bfloat16" if np.dtype(dtype) == np.dtype(jnp.bfloat16) else "float32"
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if tokenizer_json:
    import shutil
    shutil.copy(tokenizer_json, os.path.join(out_dir, "tokenizer.json"))
