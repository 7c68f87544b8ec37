"""Where the engine's program reads the host expert store from (`program_store`,
`program_stores`), and the errors of moving experts to the device.

The program reads the store per MoE layer as one stacked `[E, ...]` array per tensor kind
(or, for the engine's scan over layers, one `[L, E, ...]` array per kind), so a fetch is
one dynamic slice.  On an accelerator the arrays live in host memory: `pinned_host`
(page-locked: the copy is a DMA at the link's full speed), or `unpinned_host` with one
warning line when pinning fails.  On the CPU backend device memory *is* host memory: a
numpy (or memory-mapped) store is handed over without a copy where jax can share the
buffer (a mapped store stays the file's pages, read through the page cache: `io.repack`
lays it out so that jax can; a copy would be reported in one warning line), and a
`pinned_host` store stays in that memory kind.  Errors: `TransferError` (a store the
program cannot read: the message names the layer and tensor), `TransferTimeout` (an
emulated link whose waits exceed the engine's `transfer_timeout_s`: raised once, after
that timeout).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import staging
from moejax.io import store as store_lib


class TransferError(RuntimeError):
  """A failure moving experts to the device; the message names what failed."""


class TransferTimeout(TransferError):
  """A decode step whose result (and so its copies) did not arrive within the timeout."""


def _memory_kinds(store, device) -> list:
  """Where the program may read the store from, best first (None: the device's default
  memory, which on the CPU backend is host memory)."""
  kinds = store_lib.memory_kinds(device)
  if device.platform == "cpu":
    pinned = store_lib.store_backend(store) == "pinned_host" and "pinned_host" in kinds
    return (["pinned_host"] if pinned else []) + [None]
  return [k for k in ("pinned_host", "unpinned_host") if k in kinds]


def _put(host: np.ndarray, device, kind):
  if kind is None:
    return jax.device_put(host, device)
  return jax.device_put(host, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))


def program_stores(store, low_store, device, scan: bool, staged=None):
  """The engine's host stores as its program takes them -> (sources, pinned, scan): with
  `scan`, when `store` (and `low_store`) are one [L, E, ...] array per kind,
  {"store": {name: [L, E, ...]}, "low": ...}; else (scan False) {MoE layer: {"store":
  {name: [E, ...]}, "low": ...}} ("low" only with a low-precision store).  staged: the
  host staging tier (`io.staging.StagingCache`), read per layer (`Staged`): unrolled."""
  if staged is not None:
    low = program_store(low_store, device)[0] if low_store is not None else None
    return ({l: dict(store=staging.Staged(staged, l), **({"low": low[l]} if low else {}))
             for l in store.moe_layers}, False, False)
  if scan:
    host, pinned = program_store(store, device, stacked=True)
    low = (program_store(low_store, device, stacked=True)[0]
           if low_store is not None and host is not None else None)
    if host is not None and (low_store is None or low is not None):
      return dict(store=host, **({"low": low} if low is not None else {})), pinned, True
  host, pinned = program_store(store, device)
  low = program_store(low_store, device)[0] if low_store is not None else None
  return ({l: dict(store=v, **({"low": low[l]} if low else {})) for l, v in host.items()},
          pinned, False)


def program_store(store, device, stacked: bool = False) -> tuple[dict, bool]:
  """{MoE layer: {name: [E, ...] jax array}} for in-program copies, and whether the
  arrays are in a host memory kind the program moves slices out of.  stacked (the
  engine's scan over layers): {name: [L, E, ...]} instead, one array per tensor kind over
  the MoE layers (`io.store.layer_stacked`: the store's own memory, no copy; None when
  its layers are not one array per kind).  A store that cannot be pinned falls back to
  the next memory (one warning line)."""
  kinds = _memory_kinds(store, device)
  if not kinds:
    raise TransferError(f"{device} offers no host memory kind the decode program can read "
                        f"the expert store from (memory kinds: "
                        f"{', '.join(store_lib.memory_kinds(device))})")
  if stacked:
    whole = store_lib.layer_stacked(store)
    if whole is None:
      return None, False
    parts = {"all": (whole, "the MoE layers")}
  else:
    parts = {l: (store.stacked(l), f"MoE layer {l}") for l in store.moe_layers}
  out = {}
  copied = 0
  for key, (arrays, where) in parts.items():
    layer = {}
    for name, arr in arrays.items():
      try:
        host = np.asarray(arr)
        if host.dtype.itemsize == 2 and jnp.issubdtype(host.dtype, jnp.floating):
          host = host.view(np.uint16)     # the bits (`layer._row`): slicing bf16 costs on CPU
      except Exception as e:  # pylint: disable=broad-except  (a truncated or unreadable file)
        raise TransferError(f"cannot read expert tensor '{name}' of {where}: "
                            f"{type(e).__name__}: {e}") from e
      while True:
        try:
          layer[name] = _put(host, device, kinds[0])
          if device.platform == "cpu" and not store_lib.shares_buffer(layer[name], host):
            copied += host.nbytes
          break
        except Exception as e:  # pylint: disable=broad-except  (pinning can fail for size)
          if len(kinds) == 1:
            raise TransferError(f"cannot place expert tensor '{name}' of {where} in "
                                f"{kinds[0] or 'device'} memory: {type(e).__name__}: {e}") from e
          print(f"[moejax] warning: the expert store cannot be held in {kinds[0]} memory "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); using "
                f"{kinds[1] or 'unpinned host (numpy)'} memory instead", file=sys.stderr)
          kinds = kinds[1:]
    out[key] = layer
  jax.block_until_ready(out)
  if copied and store_lib.store_backend(store) == "mmap":
    print(f"[moejax] warning: {copied / 1e9:.2f} GB of the mapped expert store was copied "
          f"into RAM (jax wraps a host buffer in place only at 64-byte alignment)"
          f"{store_lib.align_hint(store)}", file=sys.stderr)
  return (out["all"] if stacked else out), kinds[0] is not None
