"""The routed experts of the hub's layouts, per expert (``layers.L.mlp.experts.E.gate_proj``
...) or fused (transformers v5: ``layers.L.mlp.experts.gate_up_proj``), as the loader
reads them: into RAM (`ram_experts`) or left on disk (`mapped_experts`, the disk tier),
each tensor's dtype, shape and values checked (`check`, `finite`).

``idx`` is the loader's tensor index (`moejax.io.loader`): ``where`` (name -> file),
``files``, ``get`` and ``dtype``.
"""

from __future__ import annotations

import os

import numpy as np

from moejax.io import repack
from moejax.io.safetensors_io import CheckpointError
from moejax.io.store import LayerExperts

_FLOAT_SRC = ("F32", "F16", "BF16", "F64")


def check(idx, name: str, arr: np.ndarray, shape, check_finite: bool):
  """A tensor of a float dtype and the expected shape, free of NaN and Inf when
  `check_finite`: else a CheckpointError naming the file and tensor."""
  where = idx.where[name]
  if idx.dtype(name) not in _FLOAT_SRC:
    raise CheckpointError(f"{where}: tensor '{name}' has unsupported dtype {idx.dtype(name)} "
                          f"(expected one of {', '.join(_FLOAT_SRC)})")
  if tuple(arr.shape) != tuple(shape):
    raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(arr.shape)}, "
                          f"expected {tuple(shape)}")
  finite(idx, name, arr, check=check_finite)


def ram_experts(cfg, idx, model_dir, fused, per_expert, np_dtype, check_finite) -> dict:
  """{MoE layer: LayerExperts of stacked numpy arrays in `np_dtype`} read into RAM (each
  tensor checked for NaN/Inf as it is read)."""
  E, i_ = cfg.num_experts, cfg.moe_intermediate_size
  read = lambda name: finite(idx, name, idx.get(name), "", check_finite)   # a mapped view
  layers = {}
  src = expert_names(cfg, idx, model_dir, fused, per_expert)
  # one [L, E, ...] array per kind, each layer a view of it (`store.layer_stacked`)
  whole = {"gate_up": np.empty((len(src), E, 2 * i_, cfg.hidden_size), np_dtype),
           "down": np.empty((len(src), E, cfg.hidden_size, i_), np_dtype)}
  for j, (layer, (how, names)) in enumerate(src.items()):
    st = {k: a[j] for k, a in whole.items()}
    if how == "fused":                      # one copy into RAM, converted on the way
      for k, n in names.items():
        st[k][...] = read(n)
    else:
      for e in range(E):
        st["gate_up"][e, :i_] = read(names[e]["gate_proj"])
        st["gate_up"][e, i_:] = read(names[e]["up_proj"])
        st["down"][e] = read(names[e]["down_proj"])
    layers[layer] = LayerExperts(E, stacked=st)
  return layers


def expert_names(cfg, idx, model_dir, fused, per_expert) -> dict:
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
        check(idx, names[need], idx.files[idx.where[names[need]]].get(names[need]), shape,
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
        check(idx, per[e][w], idx.files[idx.where[per[e][w]]].get(per[e][w]), shape, False)
    out[layer] = ("per_expert", per)
  return out


def mapped_experts(cfg, idx, model_dir, fused, per_expert, np_dtype, check_finite,
                    progress) -> dict:
  """The disk tier: {MoE layer: LayerExperts of read-only memmaps [E, ...]} that jax can
  wrap without a copy (`repack`).  A fused checkpoint already in `np_dtype` and aligned
  is mapped as it is (its experts checked for NaN/Inf on the first load only:
  `repack.checked_stamp`); any other is repacked once into a stacked file (its experts
  checked as they are written; a reused file was checked when written)."""
  src = expert_names(cfg, idx, model_dir, fused, per_expert)
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
              finite(idx, n, direct[l][k][e], f" (expert {e})")
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        open(stamp, "w").close()
      return {l: LayerExperts(E, stacked=d) for l, d in direct.items()}

  def chunks(layer, kind):
    how, names = src[layer]
    if how == "fused":
      a = idx.get(names[kind])
      for e in range(E):
        yield finite(idx, names[kind], a[e], f" (expert {e})", check_finite, np_dtype)
      return
    for e in range(E):
      for w in (("gate_proj", "up_proj") if kind == "gate_up" else ("down_proj",)):
        yield finite(idx, names[e][w], idx.get(names[e][w]), "", check_finite, np_dtype)

  path, _ = repack.stacked_file(model_dir, cfg.moe_layers, E, kinds, np_dtype, chunks,
                                progress)
  maps = repack.open_stacked(path, cfg.moe_layers, kinds)
  return {l: LayerExperts(E, stacked=m) for l, m in maps.items()}


def finite(idx, name: str, a: np.ndarray, what: str = "", check: bool = True,
            dtype=None) -> np.ndarray:
  """`a` (as `dtype`), after checking it holds no NaN or Inf when `check`."""
  if check and not np.isfinite(a.astype(np.float32) if a.dtype != np.float32 else a).all():
    raise CheckpointError(f"{idx.where[name]}: tensor '{name}'{what} contains NaN or Inf")
  return a if dtype is None else a.astype(dtype, copy=False)
