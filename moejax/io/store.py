"""ExpertStore: the routed experts of every MoE layer, on the host, by (layer, expert).

Each MoE layer holds a dict of arrays with a leading expert axis in moejax's
canonical layout ``{"gate_up": [E, 2I, D], "down": [E, D, I]}``.  The arrays are
numpy arrays in RAM, or read-only memmaps of the checkpoint (``mmap=True``,
disk tier) when the checkpoint stores the fused layout; per-expert checkpoints
are kept as per-expert views and concatenated on access.

Back-ends: where the routed experts wait on the host side.

  * ``numpy``: numpy arrays in RAM (what `load_model` gives by default).
  * ``mmap``: read-only memmaps of a safetensors file, the disk tier for
    models larger than RAM (`load_model(dir, mmap=True)` gives one for both
    checkpoint layouts; any other store is spilled to a file first).
  * ``pinned_host``: one jax array per expert tensor in the device's
    ``pinned_host`` memory, where the backend offers that memory kind (jax's
    CPU backend does); the transfer is then a `device_put` from pinned host to
    device memory, the fast DMA path on a GPU.

`make_store(store, backend)` converts between them; all give identical
experts (tests/test_store.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import repack
from moejax.io.safetensors_io import NAMES, SafetensorsFile, save_file


@dataclasses.dataclass
class LayerExperts:
  """Either stacked arrays {name: [E, ...]} or a per-expert getter."""
  num_experts: int
  stacked: dict[str, np.ndarray] | None = None
  getter: Callable[[int], dict[str, np.ndarray]] | None = None

  def expert(self, e: int) -> dict[str, np.ndarray]:
    if not 0 <= e < self.num_experts:
      raise IndexError(f"expert {e} out of range [0, {self.num_experts})")
    if self.stacked is not None:
      return {k: v[e] for k, v in self.stacked.items()}
    return self.getter(e)

  def stack(self) -> dict[str, np.ndarray]:
    if self.stacked is not None:
      return self.stacked
    per = [self.getter(e) for e in range(self.num_experts)]
    return {k: np.stack([p[k] for p in per]) for k in per[0]}


class ExpertStore:
  """Host-side routed experts, addressable by (layer, expert)."""

  def __init__(self, layers: dict[int, LayerExperts], num_layers: int, backend: str = "numpy"):
    self.layers = layers
    self.num_layers = num_layers
    self.backend = backend  # "numpy" | "mmap" | "pinned_host" (moejax.io.store)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(sorted(self.layers))

  def get(self, layer: int, expert: int) -> dict[str, np.ndarray]:
    if layer not in self.layers:
      raise KeyError(f"layer {layer} has no routed experts")
    return self.layers[layer].expert(expert)

  def stacked(self, layer: int) -> dict[str, np.ndarray]:
    return self.layers[layer].stack()

  def expert_nbytes(self, layer: int | None = None) -> int:
    """One expert's bytes in MoE `layer`; None: the mean over the MoE layers, rounded up.
    Layers differ where a GGUF's layers mix formats (a Q4_K_M file: "down@q6_k" in some,
    "down@q4_k" in others); with the mean, every layer's slots add up to a budget's bytes."""
    if layer is None:
      per = [self.expert_nbytes(l) for l in self.moe_layers]
      return -(-sum(per) // len(per))
    st = getattr(self.layers.get(layer), "stacked", None)
    if st is not None:          # from the shapes: no expert sliced out
      return sum(int(v.nbytes) // int(v.shape[0]) for v in st.values())
    return sum(int(v.nbytes) for v in self.get(layer, 0).values())

  def to_device(self, dtype=None) -> list:
    """All experts resident: per layer a dict of device arrays (None for dense layers).

    Arrays are copied (``jnp.array``), never aliased to the host buffers.
    """
    out = []
    for i in range(self.num_layers):
      if i not in self.layers:
        out.append(None)
        continue
      st = self.stacked(i)
      # `dtype` casts floating tensors only: MXFP4 blocks/scales (uint8) keep their bytes.
      out.append({k: jnp.array(np.asarray(v), dtype=(dtype if dtype and _is_float(v.dtype)
                                                     else _jnp_dtype(v.dtype)))
                  for k, v in st.items()})
    return out

  def device_experts(self, dtype=None) -> list:
    """Every expert for the all-resident path (the Sampler), read-only.  On the CPU
    backend, where device memory is host RAM, a numpy or mapped store already in `dtype`
    is handed to jax in place: no second copy of the experts, and a mapped store stays
    the file's pages (page cache, as llama.cpp's mmap).  Elsewhere: `to_device`."""
    dev = jax.devices()[0]
    if dev.platform != "cpu" or self.backend == "pinned_host":
      return self.to_device(dtype)
    copied = unaligned_bytes(self) if self.backend == "mmap" else 0
    if copied:     # never silently: the plan counted the file's pages, not RAM
      print(f"[moejax] warning: {getattr(self, 'path', 'the mapped store')}: "
            f"{copied / 1e9:.2f} GB of the mapped experts start off jax's 64-byte alignment "
            f"and are copied into RAM to be resident{align_hint(self)}", file=sys.stderr)
    out = []
    for i in range(self.num_layers):
      if i not in self.layers:
        out.append(None)
        continue
      st = {k: np.asarray(v) for k, v in self.stacked(i).items()}
      if dtype is not None and any(_is_float(v.dtype) and np.dtype(v.dtype) != jnp.dtype(dtype)
                                   for v in st.values()):
        return self.to_device(dtype)
      out.append({k: jax.device_put(v, dev) for k, v in st.items()})
    return out

  @classmethod
  def from_stacked(cls, per_layer: list, num_layers: int | None = None) -> "ExpertStore":
    """Build from a list over layers of {name: [E, ...]} (None for dense layers), copied
    into one [L, ...] array per name when every layer's shapes agree (`layer_stacked`)."""
    per = {i: {k: np.asarray(v) for k, v in st.items()}
           for i, st in enumerate(per_layer) if st is not None}
    per = stack_layers(per)
    layers = {i: LayerExperts(num_experts=next(iter(st.values())).shape[0], stacked=st)
              for i, st in per.items()}
    return cls(layers, num_layers if num_layers is not None else len(per_layer))


def stack_layers(per: dict) -> dict:
  """{layer: {name: [E, ...]}} as views of one [L, E, ...] numpy array per name (one
  copy), so that `layer_stacked` finds them; returned as given when the layers' names,
  shapes or dtypes differ."""
  if not per:
    return per
  first = next(iter(per.values()))
  if any(set(st) != set(first) or any(st[k].shape != first[k].shape or
                                      st[k].dtype != first[k].dtype for k in first)
         for st in per.values()):
    return per
  out = {l: {} for l in per}
  for k, a in first.items():
    big = empty_aligned((len(per),) + a.shape, a.dtype)
    for j, l in enumerate(per):
      big[j] = per[l][k]
      out[l][k] = big[j]
  return out


def empty_aligned(shape, dtype, align: int = 64) -> np.ndarray:
  """np.empty whose data starts on an `align`-byte boundary: jax's CPU backend takes a
  numpy buffer without a copy only at 64-byte alignment (a stacked store copied into the
  program would hold the experts twice)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + align, np.uint8)
  at = (-raw.ctypes.data) % align
  return raw[at:at + nbytes].view(dtype).reshape(shape)


def aligned_copy(a) -> np.ndarray:
  """A copy of `a` in RAM at jax's alignment (`empty_aligned`; np.array's large
  allocations start at 16 mod 64, which jax would copy once more)."""
  out = empty_aligned(np.shape(a), np.asarray(a).dtype)
  out[...] = a
  return out


def align_hint(store: "ExpertStore") -> str:
  """How to avoid copying a mapped GGUF's unaligned experts (empty for other stores)."""
  path = getattr(store, "path", None)
  return (f"; `moejax-align-gguf --model_dir={path}` aligns the file once (in place)"
          if isinstance(path, str) and path.endswith(".gguf") else "")


def unaligned_bytes(store: "ExpertStore") -> int:
  """Bytes of the store's stacked expert arrays that jax's CPU client cannot wrap in place
  (data not at `repack.JAX_ALIGN`: a GGUF as llama.cpp writes it maps at 32 mod 64), so
  that handing them to a program copies them."""
  n = 0
  for l in store.moe_layers:
    for v in (getattr(store.layers[l], "stacked", None) or {}).values():
      if isinstance(v, np.ndarray) and v.size and not repack.aligned(v):
        n += v.nbytes
  return n


def _root(a):
  while isinstance(getattr(a, "base", None), np.ndarray):
    a = a.base
  return getattr(a, "base", None) if getattr(a, "base", None) is not None else a


def layer_stacked(store: "ExpertStore") -> dict | None:
  """{name: [L, E, ...] numpy view} over the MoE layers in order, when each layer's
  array of that name is the next slab of one C-contiguous allocation (`stack_layers`,
  the repacked file's one tensor per kind, `to_numpy`, `to_mmap`): no copy.  None for
  any other store (per-expert getters, pinned arrays, layers read separately)."""
  layers = store.moe_layers
  get = lambda l: getattr(store.layers[l], "stacked", store.layers[l])   # or a LowStore's dict
  if not layers or any(not isinstance(get(l), dict) for l in layers):
    return None
  per = [get(l) for l in layers]
  out = {}
  for k, a in per[0].items():
    arrs = [st.get(k) for st in per]
    if not all(isinstance(x, np.ndarray) and x.flags.c_contiguous and x.shape == a.shape
               and x.dtype == a.dtype and _root(x) is _root(a) for x in arrs):
      return None
    ptr = a.__array_interface__["data"][0]
    if any(x.__array_interface__["data"][0] != ptr + j * a.nbytes for j, x in enumerate(arrs)):
      return None
    out[k] = np.lib.stride_tricks.as_strided(a, (len(arrs),) + a.shape,
                                             (a.nbytes,) + a.strides, writeable=False)
  return out


def _jnp_dtype(dt):
  return jnp.dtype(dt)


def _is_float(dt) -> bool:
  return jnp.issubdtype(jnp.dtype(dt), jnp.floating)


# ------------------------------------------------------------------ back-ends
BACKENDS = ("numpy", "mmap", "pinned_host")
SPILL_FILE = "experts.safetensors"


def _host_pointer(x) -> int | None:
  if isinstance(x, np.ndarray):
    return x.__array_interface__["data"][0]
  if isinstance(x, jax.Array):
    try:
      return x.unsafe_buffer_pointer()
    except Exception:  # pylint: disable=broad-except  (sharded / deleted arrays)
      return None
  return None


def shares_buffer(out: jax.Array, src) -> bool:
  """True when device array `out` aliases the memory of `src` (numpy or jax)."""
  p = _host_pointer(src)
  if p is None or getattr(src, "size", 1) == 0:
    return False
  try:
    return out.unsafe_buffer_pointer() == p
  except Exception:  # pylint: disable=broad-except
    return False


def owned_device_put(x, sharding: jax.sharding.Sharding) -> jax.Array:
  """`jax.device_put(x, sharding)` whose result never aliases x's buffer (slot buffers
  and pinned copies must be owned: on the CPU backend a put may wrap the numpy buffer).

  On an accelerator the put is the host->device copy itself.  On the CPU
  backend jax may wrap the numpy buffer (even a read-only memmap) or return
  the source array; then a private host copy is put instead, which only the
  returned array references (cheaper than an XLA copy, which would also
  compile once per shape).
  """
  out = jax.device_put(x, sharding)
  if shares_buffer(out, x):
    out = jax.device_put(np.array(x, copy=True), sharding)
  return out


class StoreBackendError(ValueError):
  """An expert store back-end that is unknown or unavailable here."""


def store_backend(store: ExpertStore) -> str:
  return getattr(store, "backend", "numpy")


def memory_kinds(device=None) -> list[str]:
  device = device if device is not None else jax.devices()[0]
  return [m.kind for m in device.addressable_memories()]


def make_store(store: ExpertStore, backend: str, *, path: str | None = None,
               device=None, flag: str = "--store") -> ExpertStore:
  """The same experts in `backend` ("numpy" | "mmap" | "pinned_host").

  Args:
    store: any ExpertStore (returned unchanged when already in `backend`).
    backend: the target back-end.
    path: for "mmap" from a store that is not memory-mapped yet: the folder to
      spill ``experts.safetensors`` into (default: a temporary folder removed
      when the returned store is garbage-collected).
    device: for "pinned_host": the device whose pinned_host memory holds the
      experts (default: jax.devices()[0]).
    flag: the command-line flag named in errors.
  """
  if backend not in BACKENDS:
    raise StoreBackendError(f"{flag}={backend!r}: unknown expert store backend; "
                            f"choose one of {', '.join(BACKENDS)}")
  if store_backend(store) == backend:
    return store
  if backend == "numpy":
    return to_numpy(store)
  if backend == "mmap":
    return to_mmap(store, path, flag=flag)
  return to_pinned_host(store, device, flag=flag)


def to_numpy(store: ExpertStore) -> ExpertStore:
  """Every expert as a numpy array in RAM (read from disk / pinned memory once)."""
  per = {i: {k: np.asarray(v) for k, v in store.stacked(i).items()} for i in store.moe_layers}
  st = stack_layers(per)      # one copy into [L, E, ...] arrays (`layer_stacked`)
  if st is per:               # layers of different shapes: a copy each
    st = {i: {k: aligned_copy(v) for k, v in d.items()} for i, d in per.items()}
  layers = {i: LayerExperts(store.layers[i].num_experts, stacked=d) for i, d in st.items()}
  return ExpertStore(layers, store.num_layers, backend="numpy")


def to_mmap(store: ExpertStore, path: str | None = None, flag: str = "--store") -> ExpertStore:
  """Spills the experts into one safetensors file and maps it read-only.

  Tensors are named ``experts.{name}`` [L, E, ...] when every MoE layer's shapes agree
  (`layer_stacked` then finds them), else ``layers.{i}.{name}`` [E, ...]; any expert
  dict (also biases or MXFP4 blocks of other families) round-trips.
  """
  tmp = None
  if path is None:
    tmp = tempfile.TemporaryDirectory(prefix="moejax_experts_")
    path = tmp.name
  os.makedirs(path, exist_ok=True)
  fname = os.path.join(path, SPILL_FILE)
  per = {i: {k: np.asarray(v) for k, v in store.stacked(i).items()} for i in store.moe_layers}
  for i, st in per.items():
    for k, v in st.items():
      if v.dtype not in NAMES:
        raise StoreBackendError(f"{flag}=mmap: expert tensor '{k}' of layer {i} has dtype "
                                f"{v.dtype}, which safetensors cannot store")
  # layers of one shape: one tensor per kind [L, E, ...] (`layer_stacked`), else per layer
  whole = layer_stacked(store)
  if whole is None and stack_layers(per) is not per:
    whole = {k: np.stack([st[k] for st in per.values()]) for k in next(iter(per.values()))}
  if whole is not None:
    save_file({f"experts.{k}": v for k, v in whole.items()}, fname, {"format": "moejax-experts"})
  else:
    save_file({f"layers.{i}.{k}": v for i, st in per.items() for k, v in st.items()}, fname,
              {"format": "moejax-experts"})
  f = SafetensorsFile(fname)
  get = ((lambda j, i, k: f.get(f"experts.{k}")[j]) if whole is not None
         else (lambda j, i, k: f.get(f"layers.{i}.{k}")))
  layers = {i: LayerExperts(store.layers[i].num_experts,
                            stacked={k: get(j, i, k) for k in st})
            for j, (i, st) in enumerate(per.items())}
  out = ExpertStore(layers, store.num_layers, backend="mmap")
  out.path = fname
  out._tmpdir = tmp  # pylint: disable=protected-access  (lives as long as the store)
  return out


def to_pinned_host(store: ExpertStore, device=None, flag: str = "--store") -> ExpertStore:
  """Every expert as owned jax arrays in `device`'s pinned_host memory."""
  device = device if device is not None else jax.devices()[0]
  kinds = memory_kinds(device)
  if "pinned_host" not in kinds:
    raise StoreBackendError(
        f"{flag}=pinned_host: the expert store backend 'pinned_host' is unavailable: "
        f"{device} offers memory kinds {', '.join(kinds) or 'none'}; use 'numpy' or 'mmap'")
  sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  layers = {}
  for i in store.moe_layers:
    n = store.layers[i].num_experts
    per = []
    for e in range(n):
      per.append({k: owned_device_put(np.asarray(v), sharding)
                  for k, v in store.get(i, e).items()})
    jax.block_until_ready(per)
    layers[i] = LayerExperts(n, getter=lambda e, per=per: dict(per[e]))
  return ExpertStore(layers, store.num_layers, backend="pinned_host")
