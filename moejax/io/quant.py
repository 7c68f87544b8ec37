"""Low-precision copies of the routed experts: int8 per row, int4 per group, on disk once.

A `LowStore` holds, per MoE layer and expert tensor `name` ([E, ..., C], C the last
axis, the one a row's dot product runs over), two arrays:

  name.q   int8 [E, ..., C]        (bits=8)  q = round(w / s), |q| <= 127
           uint8 [E, ..., C/2]     (bits=4)  two codes a byte, q + 8 in [0, 15]: the
                                             even column in the low nibble
  name.s   bfloat16 [E, ..., 1]    (bits=8)  one scale per row (output channel)
           bfloat16 [E, ..., C/G]  (bits=4)  one scale per group of G columns

Quantisation is symmetric (w' = q * s, no zero point).  int8: s = max|w| / 127 over the
row, rounded *up* to the next bfloat16, so no code is clipped and w' is within s / 2 of w
everywhere.  int4: codes in [-8, 7] (all 16 levels) and, per group, the scale of least
squared error among s = max|w| / d for d in 6.5, 6.625, ..., 8, each rounded up to a
bfloat16 (d = 7 is the plain rule, so no group is worse than with it); at d = 8 the
extreme of one sign takes code -8 exactly and the other side is clipped at 7, so w' is
within s of w (s / 2 where nothing is clipped).  The search cuts the int4
weights' squared error by 19% on the demo model (G = 32; docs/policies.md).  Bytes
per expert (what a `FETCH_LOW` moves): C + 2 per row for int8 (2x fewer than bf16 up to
the scale), C / 2 + 2 C / G per row for int4 (3.6x fewer at G = 32, 3.8x at G = 64).

Made once per (checkpoint, bits, group) and cached on disk in
``$MOEJAX_CACHE/quant/<key>/`` (default ``~/.cache/moejax``; the checkpoint folder is
never written).  The key hashes the checkpoint's identity (`checkpoint_hash`: each
safetensors file's name, size, mtime and header, and config.json), or the expert bytes
themselves for a store without a folder; the file carries the sha256 of its payload,
checked on load: a corrupt or stale file is rebuilt, not used.

A store of ggml blocks (--weights=q8_0/q4_0/q4_k/q6_k or a GGUF file, `io.weights.quantized`) has
no low-precision copy: its full fetch already moves the blocks (`check_float` refuses).
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.io import store as store_lib

BITS = (8, 4)
GROUPS = (32, 64)
_INT8_QMAX = 127
_BF16 = ml_dtypes.bfloat16


class QuantError(ValueError):
  """A low-precision format that cannot hold these experts; the message names the flag."""


def check_format(bits: int, group: int, shapes: dict | None = None):
  """bits in BITS, group in GROUPS and (int4) dividing every tensor's last axis."""
  if bits not in BITS:
    raise QuantError(f"--low_bits must be one of {BITS}, got {bits}")
  if group not in GROUPS:
    raise QuantError(f"--low_group must be one of {GROUPS}, got {group}")
  for name, shp in (shapes or {}).items():
    if bits == 4 and shp[-1] % group:
      raise QuantError(f"--low_group={group} does not divide the last axis ({shp[-1]}) of "
                       f"expert tensor '{name}'; use {GROUPS[0]}" if group != GROUPS[0] else
                       f"int4 needs the last axis of '{name}' ({shp[-1]}) to be a multiple "
                       f"of {group}")


def _scale_up(amax, qmax: float):
  """amax / qmax rounded up to a bfloat16 (0 rows: scale 1, every code 0)."""
  s = np.where(amax > 0, amax / np.float32(qmax), 1.0).astype(np.float32)
  b = s.astype(_BF16)
  low = b.astype(np.float32) < s
  bits = b.view(np.uint16) + low.astype(np.uint16)      # next bf16 up (positive numbers)
  return bits.view(_BF16)


INT4_DIVISORS = tuple(6.5 + 0.125 * i for i in range(13))      # max|w| / d: the search


def _codes(wg, s, bits: int):
  """Codes of the groups wg [..., G] at scales s [...] (bfloat16), clipped to the range."""
  lo, hi = (-127, 127) if bits == 8 else (-8, 7)
  return np.clip(np.rint(wg / s.astype(np.float32)[..., None]), lo, hi)


def _int4_scales(wg):
  """Per group of wg [..., G]: the bfloat16 scale of least squared error (docstring)."""
  amax = np.max(np.abs(wg), axis=-1)
  sse = lambda s: np.sum(np.square(_codes(wg, s, 4) * s.astype(np.float32)[..., None] - wg), -1)
  best_s = _scale_up(amax, 7)                  # the plain rule first: it wins the ties
  best = sse(best_s)
  for d in INT4_DIVISORS:
    s = _scale_up(amax, d)
    err = sse(s)
    better = err < best
    best, best_s = np.where(better, err, best), np.where(better, s, best_s)
  return best_s


def quantize(w, bits: int, group: int = 32):
  """w [..., C] (any float) -> (q, s) as in the module docstring (numpy)."""
  w = np.asarray(w, np.float32)
  c = w.shape[-1]
  g = c if bits == 8 else group
  wg = w.reshape(w.shape[:-1] + (c // g, g))
  s = _scale_up(np.max(np.abs(wg), axis=-1), _INT8_QMAX) if bits == 8 else _int4_scales(wg)
  q = _codes(wg, s, bits).astype(np.int8).reshape(w.shape)
  if bits == 4:
    u = (q + 8).astype(np.uint8)
    q = u[..., 0::2] | (u[..., 1::2] << 4)
  return q, s


def dequantize(q, s, bits: int, dtype=jnp.float32):
  """(q, s) -> w' = q * s [..., C] in `dtype` (jnp: runs inside the program).  s may be
  bfloat16 or its uint16 bits (the program store's layout)."""
  s = jnp.asarray(s)
  if s.dtype == jnp.uint16:
    s = jax.lax.bitcast_convert_type(s, jnp.bfloat16)
  s = s.astype(jnp.float32)
  q = jnp.asarray(q)
  if bits == 4:
    lo = (q & 0xF).astype(jnp.int32) - 8
    hi = (q >> 4).astype(jnp.int32) - 8
    q = jnp.stack([lo, hi], axis=-1).reshape(q.shape[:-1] + (2 * q.shape[-1],))
  c = q.shape[-1]
  ng = s.shape[-1]
  w = q.astype(jnp.float32).reshape(q.shape[:-1] + (ng, c // ng)) * s[..., None]
  return w.reshape(q.shape).astype(dtype)


def low_nbytes(shapes: dict, bits: int, group: int = 32) -> int:
  """Bytes of one expert's low-precision copy; shapes: {name: shape without E}."""
  n = 0
  for shp in shapes.values():
    rows, c = int(np.prod(shp[:-1])), shp[-1]
    n += rows * (c + 2) if bits == 8 else rows * (c // 2 + 2 * (c // group))
  return n


def bf16_nbytes(shapes: dict) -> int:
  """Bytes of one expert in bfloat16 (what 'waited bytes' count for a full fetch)."""
  return sum(2 * int(np.prod(s)) for s in shapes.values())


class LowStore:
  """Low-precision copies of an ExpertStore's experts: per MoE layer {name.q, name.s}
  stacked over experts (the `program_store` layout of a store)."""

  def __init__(self, layers: dict, num_layers: int, bits: int, group: int,
               shapes: dict, key: str = ""):
    self.layers, self.num_layers, self.bits, self.group = layers, num_layers, bits, group
    self.shapes, self.key = shapes, key
    self.backend = "numpy"
    self.path = None          # the disk cache file, when there is one
    self.reused = False       # loaded from the disk cache (not rebuilt)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(sorted(self.layers))

  def stacked(self, layer: int) -> dict:
    return self.layers[layer]

  def expert_nbytes(self) -> int:
    return low_nbytes(self.shapes, self.bits, self.group)

  def dequantized(self, dtype=jnp.float32) -> list:
    """Per layer {name: [E, ...] dequantised on the device} (None for dense layers): the
    emulator's table of low-precision experts, laid out as `ExpertStore.to_device`."""
    out = [None] * self.num_layers
    for l, d in self.layers.items():
      out[l] = {n: dequantize(d[n + ".q"], d[n + ".s"], self.bits, dtype) for n in self.shapes}
    return out


def _payload_hash(arrays: dict) -> str:
  h = hashlib.sha256()
  for k in sorted(arrays):
    a = np.ascontiguousarray(arrays[k])
    h.update(k.encode() + str(a.dtype).encode() + str(a.shape).encode())
    h.update(a.view(np.uint8).reshape(-1).data)
  return h.hexdigest()


def checkpoint_hash(model_dir: str) -> str:
  """A checkpoint's identity without reading its weights: config.json and, per
  safetensors file, its name, size, mtime and header (which lists every tensor)."""
  h = hashlib.sha256()
  for name in sorted(os.listdir(model_dir)):
    p = os.path.join(model_dir, name)
    if name == "config.json":
      with open(p, "rb") as f:
        h.update(f.read())
    elif name.endswith(".safetensors"):
      st = os.stat(p)
      with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h.update(name.encode() + str((st.st_size, st.st_mtime_ns)).encode() + f.read(n))
  return h.hexdigest()[:24]


def cache_root() -> str:
  return os.path.join(os.environ.get("MOEJAX_CACHE") or
                      os.path.join(os.path.expanduser("~"), ".cache", "moejax"), "quant")


def check_float(store):
  """A QuantError unless the store's experts are floats: a store of ggml blocks
  (--weights, a GGUF file: `io.weights.quantized`) already moves 4-8 bit bytes on a full fetch
  and has no float copy to make a lower-precision one from."""
  names = list(store.get(store.moe_layers[0], 0))
  if any("@" in n for n in names):
    raise QuantError(f"--miss=fetch_low / threshold_low fetch a low-precision copy of float "
                     f"experts, but this store holds ggml blocks ({', '.join(names)}): its "
                     f"full fetch already moves quantized bytes; use another --miss rule")


def build(store, bits: int, group: int = 32, key: str = "") -> LowStore:
  """The LowStore of `store` (quantised now, in memory)."""
  check_float(store)
  first = store.get(store.moe_layers[0], 0)
  shapes = {k: tuple(np.shape(v)) for k, v in first.items()}
  check_format(bits, group, shapes)
  layers = {}
  for l in store.moe_layers:
    d = {}
    for name, arr in store.stacked(l).items():
      d[name + ".q"], d[name + ".s"] = quantize(np.asarray(arr, np.float32), bits, group)
    layers[l] = d
  return LowStore(store_lib.stack_layers(layers), store.num_layers, bits, group, shapes, key)


def load_or_build(store, bits: int, group: int = 32, model_dir: str | None = None,
                  cache_dir: str | None = None) -> LowStore:
  """The LowStore of `store`, from the disk cache when a valid copy is there (`reused`),
  else built and written there.  The key: `checkpoint_hash(model_dir)` with bits and
  group; without model_dir the sha256 of the experts' bytes."""
  check_float(store)
  if model_dir is not None:
    ident = checkpoint_hash(model_dir)
  else:
    ident = _payload_hash({f"{l}.{k}": np.asarray(v) for l in store.moe_layers
                           for k, v in store.stacked(l).items()})[:24]
  # int4's "-mse": the scale search (files made before it have another key, so rebuilt)
  key = f"{ident}-int{bits}" + (f"-g{group}-mse" if bits == 4 else "")
  folder = os.path.join(cache_dir or cache_root(), key)
  path = os.path.join(folder, "experts.npz")
  meta_path = os.path.join(folder, "meta.json")
  if os.path.exists(path) and os.path.exists(meta_path):
    try:
      with open(meta_path) as f:
        meta = json.load(f)
      with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
      if meta.get("sha256") == _payload_hash(arrays) and meta.get("key") == key:
        layers = {}
        for k, v in arrays.items():
          l, name = k.split("/", 1)
          layers.setdefault(int(l), {})[name] = v if not name.endswith(".s") else v.view(_BF16)
        shapes = {k: tuple(v) for k, v in meta["shapes"].items()}
        low = LowStore(store_lib.stack_layers(layers), store.num_layers, bits, group, shapes,
                       key)
        low.path, low.reused = path, True
        return low
    except Exception:  # pylint: disable=broad-except  (a corrupt zip, json or array)
      pass                                      # rebuilt below
  low = build(store, bits, group, key)
  arrays = {f"{l}/{k}": (v.view(np.uint16) if k.endswith(".s") else v)
            for l, d in low.layers.items() for k, v in d.items()}
  try:
    os.makedirs(folder, exist_ok=True)
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)
    with open(meta_path, "w") as f:
      json.dump(dict(key=key, bits=bits, group=group, sha256=_payload_hash(arrays),
                     shapes=low.shapes), f)
    low.path = path
  except OSError:
    pass                                        # a read-only cache: kept in memory only
  return low
