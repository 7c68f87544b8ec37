"""Where the engine's program reads the host store, and the waits on its results.

`program_store(store, device)` lays the routed experts out for in-program copies: per
MoE layer one stacked `[E, ...]` array per tensor kind, so a fetch is one dynamic
slice.  On an accelerator the arrays live in host memory: `pinned_host` (page-locked:
the copy is a DMA at the link's full speed), or `unpinned_host` with one warning line
when pinning fails.  On the CPU backend device memory *is* host memory: a numpy (or
memory-mapped) store is handed over without a copy where jax can share the buffer,
and a `pinned_host` store stays in that memory kind.

Errors: `TransferError` (a store the program cannot read: the message names the
layer and tensor), `TransferTimeout` (a result not ready within the timeout).
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from moejax.offload import host_store


class TransferError(RuntimeError):
  """A failure moving experts to the device; the message names what failed."""


class TransferTimeout(TransferError):
  """A decode step whose result (and so its copies) did not arrive within the timeout."""


def sleep_until(deadline: float, spin_s: float = 2e-4):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop
  (a plain sleep on a loaded machine overshoots by milliseconds)."""
  while (left := deadline - time.perf_counter()) > 0:
    time.sleep(left - spin_s if left > 2 * spin_s else 0)


def wait_ready(arrays, timeout_s: float, what: str):
  """Blocks until every array is ready; TransferTimeout after `timeout_s` (raised once:
  nothing else waits on the step afterwards)."""
  leaves = [a for a in jax.tree_util.tree_leaves(arrays) if isinstance(a, jax.Array)]
  if all(a.is_ready() for a in leaves):
    return
  deadline = time.perf_counter() + timeout_s
  while not all(a.is_ready() for a in leaves):
    if time.perf_counter() > deadline:
      raise TransferTimeout(f"{what} did not complete within transfer_timeout_s={timeout_s:g}")
    time.sleep(1e-4)


def _memory_kind(device) -> str | None:
  """The memory the program reads the store from (None: device memory = host, CPU)."""
  if device.platform == "cpu":
    return None
  kinds = host_store.memory_kinds(device)
  return "pinned_host" if "pinned_host" in kinds else "unpinned_host"


def program_store(store, device) -> tuple[dict, bool]:
  """{MoE layer: {name: [E, ...] jax array}} for in-program copies, and whether the
  arrays are in a host memory kind the program must move slices out of."""
  kind = _memory_kind(device)
  if host_store.store_backend(store) == "pinned_host" and device.platform == "cpu":
    kind = "pinned_host"
  out, warned = {}, False
  for l in store.moe_layers:
    layer = {}
    for name, arr in store.stacked(l).items():
      try:
        host = np.asarray(arr)
        if kind is None:
          layer[name] = jax.device_put(host, device)
          continue
        try:
          layer[name] = jax.device_put(host, jax.sharding.SingleDeviceSharding(device,
                                                                              memory_kind=kind))
        except Exception as e:  # pylint: disable=broad-except  (pinning can fail for size)
          if kind != "pinned_host":
            raise
          if not warned:
            print(f"[moejax] warning: the expert store could not be pinned ({type(e).__name__}: "
                  f"{e}); reading it from unpinned host memory (slower copies)", file=sys.stderr)
            warned = True
          kind = "unpinned_host"
          layer[name] = jax.device_put(host, jax.sharding.SingleDeviceSharding(device,
                                                                              memory_kind=kind))
      except Exception as e:  # pylint: disable=broad-except
        raise TransferError(f"cannot read expert tensor '{name}' of MoE layer {l}: "
                            f"{type(e).__name__}: {e}") from e
    out[l] = layer
  jax.block_until_ready(out)
  return out, kind is not None
