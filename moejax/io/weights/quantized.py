"""--weights: a float checkpoint's linears as ggml blocks, repacked once into the cache.

`load_model(dir, weights="q4_0")` (and q8_0, q4_k, q6_k; "float" keeps the checkpoint's
floats) quantizes, as llama-quantize does, the routed experts and every dense linear:
attention's q/k/v/o, shared experts and dense MLPs, the LM head and the embeddings
(`dense_format`).  Norms, routers and anything else keep their precision.  A row that
`qtype`'s block does not divide falls back as llama.cpp's K-quants do (q4_k -> q4_0,
q6_k -> q8_0; a row of no multiple of 32 stays float).

The repack (`build`) streams the checkpoint tensor by tensor (never more than one tensor or
one expert in f32) into one safetensors file under
``$MOEJAX_CACHE_DIR/weights/<folder>-<key>-<qtype>/weights.safetensors`` (the key: the
checkpoint's shards' names, sizes and mtimes, as `repack`), with a progress bar on stderr
and the free disk checked first; later runs map it.  It holds

  params/<path>            a dense parameter: uint8 blocks [O, C / block * type_size] when
                           quantized, else float32 (the path is the Flax one, '/'-joined)
  experts.<kind>@<qtype>   uint8 blocks [L, E, rows, nbytes] per expert kind ("gate_up",
                           "down") over the MoE layers in order, each page-aligned: the
                           disk tier's stacked layout (`repack`), so the store maps it

and its metadata names each tensor's format.  The loader makes the linears `QuantArray`s
(moejax.ggml) and an ExpertStore whose expert dicts are {"<kind>@<qtype>": blocks [E, ...]}
(`expert_key`); `moejax.model.quant_ops` turns those back into QuantArrays in the program.

`fetch_low` (io/quant.py: int8-per-row and int4-per-group copies beside a float store, for
the policies' low-precision fetches) is kept as it is: it is a second, lower-precision copy
of float experts that a policy may fetch instead of the full one; a quantized store has
no float copy to substitute for, and the engine refuses `fetch_low` on it
(`check_low`), since its full fetch already moves 4- or 8-bit bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

from moejax.ggml import blocks
from moejax.ggml import types
from moejax.io import expert_layout
from moejax.io import repack
from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, write_streamed

WEIGHTS = ("float",) + types.QTYPES
VERSION = 1
FALLBACK = {"q4_k": "q4_0", "q6_k": "q8_0"}      # as llama.cpp's K-quants on odd rows


class WeightsError(CheckpointError):
  """A --weights value or repack that cannot be made; the message names the flag."""


def check_weights(weights: str, flag: str = "--weights"):
  if weights not in WEIGHTS:
    raise WeightsError(f"{flag}={weights!r}: unknown weight format; choose one of "
                       f"{', '.join(WEIGHTS)}")


def fit(qtype: str, c: int) -> str | None:
  """The format rows of c values take under `qtype` (a fallback, or None: kept float)."""
  for q in (qtype, FALLBACK.get(qtype)):
    if q is not None and c % types.get(q).block == 0:
      return q
  return None


def dense_format(path: tuple, shape, qtype: str) -> str | None:
  """The format of dense parameter `path` (Flax names) under --weights=qtype, or None."""
  linear = (path[-1] == "embedding" or
            (path[-1] == "weight" and (path[-2].endswith("_proj") or path[-2] == "lm_head")))
  if qtype == "float" or not linear or len(shape) != 2:
    return None
  return fit(qtype, shape[-1])


def expert_key(kind: str, qtype: str) -> str:
  return f"{kind}@{qtype}"


def split_key(key: str) -> tuple[str, str | None]:
  """'gate_up@q4_0' -> ('gate_up', 'q4_0'); a float expert tensor's key -> (key, None)."""
  kind, _, q = key.partition("@")
  return kind, (q or None)


def expert_kinds(cfg, qtype: str) -> dict:
  """{store key: per-expert blocks shape} of the plain SwiGLU experts under `qtype`."""
  out = {}
  for kind, (rows, c) in (("gate_up", (2 * cfg.moe_intermediate_size, cfg.hidden_size)),
                          ("down", (cfg.hidden_size, cfg.moe_intermediate_size))):
    q = fit(qtype, c)
    if q is None:
      raise WeightsError(f"--weights={qtype}: routed expert tensor '{kind}' has rows of {c} "
                         f"values, not a multiple of 32: no block format holds it")
    out[expert_key(kind, q)] = (rows, types.get(q).row_bytes(c))
  return out


def expert_nbytes(cfg, qtype: str) -> int:
  """Bytes of one routed expert's blocks (what the store holds and a fetch moves)."""
  return int(sum(np.prod(s) for s in expert_kinds(cfg, qtype).values()))


def dense_nbytes(abstract_params, qtype: str, dtype) -> int:
  """Bytes of the dense parameters under `qtype`: blocks for the linears, else `dtype`
  (a leaf kept in f32 whatever dtype, e.g. a sigmoid router, counts as its own)."""
  import jax
  n = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    p = tuple(k.key for k in path)
    q = dense_format(p, leaf.shape, qtype)
    n += (leaf.shape[0] * types.get(q).row_bytes(leaf.shape[1]) if q else
          int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize)
  return n


def weights_path(model_dir: str, qtype: str) -> str:
  name = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
  key = repack.checkpoint_key(model_dir, np.float32)
  return os.path.join(repack.cache_root(), "weights", f"{name}-{key}-{qtype}-v{VERSION}",
                      "weights.safetensors")


def _specs(cfg, dense: dict, shapes: dict, qtype: str) -> tuple[list, dict]:
  specs, formats = [], {}
  for p, name in sorted(dense.items()):
    q = dense_format(p, shapes[p], qtype)
    key = "params/" + "/".join(p)
    formats[key] = q or "f32"
    shp = ((shapes[p][0], types.get(q).row_bytes(shapes[p][1])) if q else shapes[p])
    specs.append((key, np.uint8 if q else np.float32, shp))
  for key, shp in expert_kinds(cfg, qtype).items():
    formats["experts." + key] = split_key(key)[1]
    specs.append(("experts." + key, np.uint8, (len(cfg.moe_layers), cfg.num_experts) + shp))
  return specs, formats


def _check_free(path: str, specs, model_dir: str, qtype: str):
  total = sum(int(np.prod(s)) * np.dtype(dt).itemsize for _, dt, s in specs)
  probe = os.path.dirname(path)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  need = total + len(specs) * repack.ALIGN
  free = shutil.disk_usage(probe).free
  if free < need:
    raise WeightsError(f"{model_dir}: --weights={qtype} repacks the weights once into "
                       f"{need / 1e9:.2f} GB under {os.path.dirname(path)}, but that disk has "
                       f"{free / 1e9:.2f} GB free; free space or set MOEJAX_CACHE_DIR to a "
                       f"larger disk")
  return total


def build(cfg, idx, model_dir: str, dense: dict, shapes: dict, fused: dict, per_expert: dict,
          qtype: str, check_finite: bool = True, progress: bool | None = None) -> str:
  """The path of the quantized file of the checkpoint (written now unless there).
  dense: {Flax path: tensor name}; shapes: {Flax path: shape}; fused / per_expert: the
  loader's expert tensor names (`expert_layout.expert_names`)."""
  path = weights_path(model_dir, qtype)
  if os.path.exists(path):
    return path
  specs, formats = _specs(cfg, dense, shapes, qtype)
  src = expert_layout.expert_names(cfg, idx, model_dir, fused, per_expert)
  total = _check_free(path, specs, model_dir, qtype)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  print(f"[moejax] --weights={qtype}: quantizing the checkpoint's linears once into {path} "
        f"({total / 1e9:.2f} GB; later runs map it)", file=sys.stderr)
  read = lambda n: expert_layout.finite(idx, n, idx.get(n), "", check_finite)
  by_key = {"params/" + "/".join(p): n for p, n in dense.items()}

  def chunks(key):
    if key.startswith("params/"):
      q = formats[key]
      a = read(by_key[key])
      yield (blocks.quantize(a, q, f"'{by_key[key]}'") if q != "f32"
             else np.asarray(a, np.float32))
      return
    kind, q = split_key(key[len("experts."):])
    for layer in cfg.moe_layers:
      how, names = src[layer]
      whole = read(names[kind]) if how == "fused" else None
      for e in range(cfg.num_experts):
        if how == "fused":
          yield blocks.quantize(whole[e], q, f"'{names[kind]}' (expert {e})")
          continue
        for w in (("gate_proj", "up_proj") if kind == "gate_up" else ("down_proj",)):
          yield blocks.quantize(read(names[e][w]), q, f"'{names[e][w]}'")

  from tqdm import tqdm
  bar = tqdm(total=total, desc=f"quantizing to {qtype}", unit="B", unit_scale=True,
             unit_divisor=1000, file=sys.stderr, leave=False, mininterval=0.25,
             disable=not (sys.stderr.isatty() if progress is None else progress))
  try:
    write_streamed(path, specs, chunks, {"format": "moejax-weights", "qtype": qtype,
                                         "formats": json.dumps(formats),
                                         "source": os.path.abspath(model_dir)},
                   align=repack.ALIGN, on_bytes=bar.update)
  finally:
    bar.close()
    if os.path.exists(path + ".part"):
      os.remove(path + ".part")
  return path


def open_weights(path: str, moe_layers) -> tuple[dict, dict]:
  """({Flax path: (array, format or None)}, {MoE layer: {store key: memmap [E, ...]}})
  of a file `build` wrote; the arrays are read-only maps of it."""
  f = SafetensorsFile(path)
  formats = json.loads(f.metadata.get("formats", "{}"))
  dense, experts = {}, {l: {} for l in moe_layers}
  for key in f.keys():
    if key.startswith("params/"):
      q = formats.get(key, "f32")
      dense[tuple(key[len("params/"):].split("/"))] = (f.get(key), None if q == "f32" else q)
    elif key.startswith("experts."):
      whole = f.get(key)
      for j, l in enumerate(moe_layers):
        experts[l][key[len("experts."):]] = whole[j]
  return dense, experts
