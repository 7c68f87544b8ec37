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
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

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
    layer = self.moe_layers[0] if layer is None else layer
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
    """Build from a list over layers of {name: [E, ...]} (None for dense layers)."""
    layers = {}
    for i, st in enumerate(per_layer):
      if st is None:
        continue
      st = {k: np.asarray(v) for k, v in st.items()}
      layers[i] = LayerExperts(num_experts=next(iter(st.values())).shape[0], stacked=st)
    return cls(layers, num_layers if num_layers is not None else len(per_layer))


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
  layers = {}
  for i in store.moe_layers:
    st = store.stacked(i)
    layers[i] = LayerExperts(store.layers[i].num_experts,
                             stacked={k: np.array(v) for k, v in st.items()})
  return ExpertStore(layers, store.num_layers, backend="numpy")


def to_mmap(store: ExpertStore, path: str | None = None, flag: str = "--store") -> ExpertStore:
  """Spills the experts into one safetensors file and maps it read-only.

  Tensors are named ``layers.{i}.{name}`` with a leading expert axis, so any
  expert dict (also biases or MXFP4 blocks of other families) round-trips.
  """
  tmp = None
  if path is None:
    tmp = tempfile.TemporaryDirectory(prefix="moejax_experts_")
    path = tmp.name
  os.makedirs(path, exist_ok=True)
  fname = os.path.join(path, SPILL_FILE)
  tensors = {}
  for i in store.moe_layers:
    for k, v in store.stacked(i).items():
      v = np.asarray(v)
      if v.dtype not in NAMES:
        raise StoreBackendError(f"{flag}=mmap: expert tensor '{k}' of layer {i} has dtype "
                                f"{v.dtype}, which safetensors cannot store")
      tensors[f"layers.{i}.{k}"] = v
  save_file(tensors, fname, {"format": "moejax-experts"})
  f = SafetensorsFile(fname)
  layers = {}
  for i in store.moe_layers:
    names = [k for k in store.stacked(i)]
    layers[i] = LayerExperts(store.layers[i].num_experts,
                             stacked={k: f.get(f"layers.{i}.{k}") for k in names})
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
