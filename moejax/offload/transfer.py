"""Where the engine's program reads the host store, and the waits on its results.

`program_store(store, device)` lays the routed experts out for in-program copies: per
MoE layer one stacked `[E, ...]` array per tensor kind, so a fetch is one dynamic
slice.  On an accelerator the arrays live in host memory: `pinned_host` (page-locked:
the copy is a DMA at the link's full speed), or `unpinned_host` with one warning line
when pinning fails.  On the CPU backend device memory *is* host memory: a numpy (or
memory-mapped) store is handed over without a copy where jax can share the buffer
(a mapped store stays the file's pages, read through the page cache: `io.repack` lays
it out so that jax can; a copy would be reported in one warning line), and a
`pinned_host` store stays in that memory kind.

Errors: `TransferError` (a store the program cannot read: the message names the layer
and tensor), `TransferTimeout` (an emulated link whose waits exceed the engine's
`transfer_timeout_s`: raised once, after that timeout).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import store as store_lib


class TransferError(RuntimeError):
  """A failure moving experts to the device; the message names what failed."""


class TransferTimeout(TransferError):
  """A decode step whose result (and so its copies) did not arrive within the timeout."""


def sleep_until(deadline: float, spin_s: float = 2e-4):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop
  (a plain sleep on a loaded machine overshoots by milliseconds)."""
  while (left := deadline - time.perf_counter()) > 0:
    time.sleep(left - spin_s if left > 2 * spin_s else 0)


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


def program_store(store, device) -> tuple[dict, bool]:
  """{MoE layer: {name: [E, ...] jax array}} for in-program copies, and whether the
  arrays are in a host memory kind the program moves slices out of.  A store that
  cannot be pinned falls back to the next memory (one warning line)."""
  kinds = _memory_kinds(store, device)
  if not kinds:
    raise TransferError(f"{device} offers no host memory kind the decode program can read "
                        f"the expert store from (memory kinds: "
                        f"{', '.join(store_lib.memory_kinds(device))})")
  out = {}
  copied = 0
  for l in store.moe_layers:
    layer = {}
    for name, arr in store.stacked(l).items():
      try:
        host = np.asarray(arr)
        if host.dtype.itemsize == 2 and jnp.issubdtype(host.dtype, jnp.floating):
          host = host.view(np.uint16)     # the bits (`layer._row`): slicing bf16 costs on CPU
      except Exception as e:  # pylint: disable=broad-except  (a truncated or unreadable file)
        raise TransferError(f"cannot read expert tensor '{name}' of MoE layer {l}: "
                            f"{type(e).__name__}: {e}") from e
      while True:
        try:
          layer[name] = _put(host, device, kinds[0])
          if device.platform == "cpu" and not store_lib.shares_buffer(layer[name], host):
            copied += host.nbytes
          break
        except Exception as e:  # pylint: disable=broad-except  (pinning can fail for size)
          if len(kinds) == 1:
            raise TransferError(f"cannot place expert tensor '{name}' of MoE layer {l} in "
                                f"{kinds[0] or 'device'} memory: {type(e).__name__}: {e}") from e
          print(f"[moejax] warning: the expert store cannot be held in {kinds[0]} memory "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); using "
                f"{kinds[1] or 'unpinned host (numpy)'} memory instead", file=sys.stderr)
          kinds = kinds[1:]
    out[l] = layer
  jax.block_until_ready(out)
  if copied and store_lib.store_backend(store) == "mmap":
    print(f"[moejax] warning: {copied / 1e9:.2f} GB of the mapped expert store was copied "
          f"into RAM (jax wraps a host buffer in place only at 64-byte alignment)",
          file=sys.stderr)
  return out, kinds[0] is not None
