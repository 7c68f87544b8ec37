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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import families
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer
from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, save_file
from moejax.io.store import ExpertStore, LayerExperts

_FLOAT_SRC = ("F32", "F16", "BF16", "F64")


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


def abstract_experts(cfg: ModelConfig, dtype=jnp.float32) -> list:
  shp = expert_shapes(cfg)
  return [({k: jax.ShapeDtypeStruct((cfg.num_experts,) + v, dtype) for k, v in shp.items()}
           if s else None) for s in cfg.sparse_layers]


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
  model = Transformer(cfg, dtype)
  toks = jnp.zeros((1, 2), jnp.int32)
  return jax.eval_shape(lambda e: model.init(jax.random.PRNGKey(0), toks, e),
                        abstract_experts(cfg, dtype))["params"]


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


def _check(idx: _Index, name: str, arr: np.ndarray, shape, check_finite: bool):
  where = idx.where[name]
  if idx.dtype(name) not in _FLOAT_SRC:
    raise CheckpointError(f"{where}: tensor '{name}' has unsupported dtype {idx.dtype(name)} "
                          f"(expected one of {', '.join(_FLOAT_SRC)})")
  if tuple(arr.shape) != tuple(shape):
    raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(arr.shape)}, "
                          f"expected {tuple(shape)}")
  if check_finite and not np.isfinite(arr.astype(np.float32) if arr.dtype != np.float32 else arr).all():
    raise CheckpointError(f"{where}: tensor '{name}' contains NaN or Inf")


def load_model(model_dir: str, dtype=jnp.float32, mmap: bool = False, check_finite: bool = True,
               dequantize_mxfp4: bool = False, progress: bool | None = None):
  """Returns (cfg, params on device, ExpertStore on host).

  A family's own expert layout is read by its ``load_layer_experts``; MXFP4 experts
  (gpt_oss ``*_blocks``/``*_scales``) stay MXFP4 in the store (a fetch
  moves the 4-bit bytes; the device dequantises) unless ``dequantize_mxfp4``.
  ``progress``: a tqdm bar on stderr over the checkpoint's bytes while reading; None
  (default): only when stderr is a terminal; False: never.
  """
  cfg = ModelConfig.from_json_file(model_dir)
  family = families.of(cfg)
  idx = _Index(model_dir)
  idx.track(progress, f"loading {os.path.basename(os.path.normpath(model_dir))}")
  try:
    out = _load(cfg, family, idx, model_dir, dtype, mmap, check_finite, dequantize_mxfp4,
                progress)
    idx.close(complete=True)
    return out
  finally:
    idx.close()


def _load(cfg, family, idx: _Index, model_dir, dtype, mmap, check_finite, dequantize_mxfp4,
          progress=None):
  np_dtype = np.dtype(jnp.dtype(dtype))
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
  leaves = {}
  for p, name in dense.items():
    a = idx.get(name)
    _check(idx, name, a, flat_expected[p], check_finite)
    # a module may keep a parameter in f32 whatever `dtype` (e.g. sigmoid routers, like HF)
    leaves[p] = jnp.asarray(np.asarray(a).astype(leaf_dtypes.get(p, np_dtype)))
  params: dict[str, Any] = {}
  for p, v in leaves.items():
    d = params
    for k in p[:-1]:
      d = d.setdefault(k, {})
    d[p[-1]] = v

  # routed experts
  if family.load_layer_experts is not None:    # the family's own tensor layout
    layers = {layer: LayerExperts(cfg.num_experts, stacked=family.load_layer_experts(
        idx, fused.get(layer, {}), cfg, layer, np_dtype, dequantize_mxfp4=dequantize_mxfp4,
        mmap=mmap, check_finite=check_finite, check=_check, error=CheckpointError,
        model_dir=model_dir)) for layer in cfg.moe_layers}
  elif mmap:
    layers = _mapped_experts(cfg, idx, model_dir, fused, per_expert, np_dtype, check_finite,
                             progress)
  else:
    layers = _ram_experts(cfg, idx, model_dir, fused, per_expert, np_dtype, check_finite)
  return cfg, params, ExpertStore(layers, cfg.num_layers, backend="mmap" if mmap else "numpy")


def _ram_experts(cfg, idx: _Index, model_dir, fused, per_expert, np_dtype,
                 check_finite) -> dict:
  """{MoE layer: LayerExperts of stacked numpy arrays in `np_dtype`} read into RAM (each
  tensor checked for NaN/Inf as it is read)."""
  E, i_ = cfg.num_experts, cfg.moe_intermediate_size
  read = lambda name: _finite(idx, name, idx.get(name), "", check_finite)   # a mapped view
  layers = {}
  for layer, (how, names) in _expert_names(cfg, idx, model_dir, fused, per_expert).items():
    if how == "fused":                      # one copy into RAM, converted on the way
      st = {k: np.array(read(n), dtype=np_dtype) for k, n in names.items()}
    else:
      st = {"gate_up": np.empty((E, 2 * i_, cfg.hidden_size), np_dtype),
            "down": np.empty((E, cfg.hidden_size, i_), np_dtype)}
      for e in range(E):
        st["gate_up"][e, :i_] = read(names[e]["gate_proj"])
        st["gate_up"][e, i_:] = read(names[e]["up_proj"])
        st["down"][e] = read(names[e]["down_proj"])
    layers[layer] = LayerExperts(E, stacked=st)
  return layers


def _expert_names(cfg, idx: _Index, model_dir, fused, per_expert) -> dict:
  """{MoE layer: ("fused", {kind: name}) | ("per_expert", {e: {w: name}})}, every name
  present and every shape checked from the headers alone (nothing is read)."""
  d_, i_ = cfg.hidden_size, cfg.moe_intermediate_size
  out = {}
  for layer in cfg.moe_layers:
    if layer in fused:
      names = fused[layer]
      for need, shape in (("gate_up_proj", (cfg.num_experts, 2 * i_, d_)),
                          ("down_proj", (cfg.num_experts, d_, i_))):
        if need not in names:
          raise CheckpointError(f"{model_dir}: missing tensor "
                                f"'model.layers.{layer}.mlp.experts.{need}'")
        _check(idx, names[need], idx.files[idx.where[names[need]]].get(names[need]), shape,
               False)
      out[layer] = ("fused", {"gate_up": names["gate_up_proj"], "down": names["down_proj"]})
      continue
    per = per_expert.get(layer, {})
    for e in range(cfg.num_experts):
      for w in ("gate_proj", "up_proj", "down_proj"):
        if w not in per.get(e, {}):
          raise CheckpointError(f"{model_dir}: missing tensor "
                                f"'model.layers.{layer}.mlp.experts.{e}.{w}.weight'")
        shape = (d_, i_) if w == "down_proj" else (i_, d_)
        _check(idx, per[e][w], idx.files[idx.where[per[e][w]]].get(per[e][w]), shape, False)
    out[layer] = ("per_expert", per)
  return out


def _mapped_experts(cfg, idx: _Index, model_dir, fused, per_expert, np_dtype, check_finite,
                    progress) -> dict:
  """The disk tier: {MoE layer: LayerExperts of read-only memmaps [E, ...]} that jax can
  wrap without a copy (`repack`).  A fused checkpoint already in `np_dtype` and aligned
  is mapped as it is (its experts checked for NaN/Inf on the first load only:
  `repack.checked_stamp`); any other is repacked once into a stacked file (its experts
  checked as they are written; a reused file was checked when written)."""
  from moejax.io import repack
  src = _expert_names(cfg, idx, model_dir, fused, per_expert)
  E = cfg.num_experts
  kinds = {"gate_up": (2 * cfg.moe_intermediate_size, cfg.hidden_size),
           "down": (cfg.hidden_size, cfg.moe_intermediate_size)}
  if all(how == "fused" for how, _ in src.values()):
    direct = {l: {k: idx.files[idx.where[n]].get(n) for k, n in names.items()}
              for l, (_, names) in src.items()}
    if all(a.dtype == np_dtype and repack.aligned(a) for d in direct.values()
           for a in d.values()):
      stamp = repack.checked_stamp(model_dir, np_dtype)
      if check_finite and not os.path.exists(stamp):    # once per checkpoint: a full read
        for l, (_, names) in src.items():
          for k, n in names.items():
            for e in range(E):
              _finite(idx, n, direct[l][k][e], f" (expert {e})")
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        open(stamp, "w").close()
      return {l: LayerExperts(E, stacked=d) for l, d in direct.items()}

  def chunks(layer, kind):
    how, names = src[layer]
    if how == "fused":
      a = idx.get(names[kind])
      for e in range(E):
        yield _finite(idx, names[kind], a[e], f" (expert {e})", check_finite, np_dtype)
      return
    for e in range(E):
      for w in (("gate_proj", "up_proj") if kind == "gate_up" else ("down_proj",)):
        yield _finite(idx, names[e][w], idx.get(names[e][w]), "", check_finite, np_dtype)

  path, _ = repack.stacked_file(model_dir, cfg.moe_layers, E, kinds, np_dtype, chunks,
                                progress)
  maps = repack.open_stacked(path, cfg.moe_layers, kinds)
  return {l: LayerExperts(E, stacked=m) for l, m in maps.items()}


def _finite(idx: _Index, name: str, a: np.ndarray, what: str = "", check: bool = True,
            dtype=None) -> np.ndarray:
  """`a` (as `dtype`), after checking it holds no NaN or Inf when `check`."""
  if check and not np.isfinite(a.astype(np.float32) if a.dtype != np.float32 else a).all():
    raise CheckpointError(f"{idx.where[name]}: tensor '{name}'{what} contains NaN or Inf")
  return a if dtype is None else a.astype(dtype, copy=False)


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
