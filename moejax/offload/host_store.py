"""ExpertStore back-ends: where the routed experts wait on the host side.

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

import os
import tempfile

import jax
import numpy as np

from moejax.safetensors_io import NAMES, SafetensorsFile, save_file
from moejax.store import ExpertStore, LayerExperts

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
