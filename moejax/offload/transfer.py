"""Host->device expert transfers: one prefetch thread issuing `jax.device_put`.

The engine asks for experts with `Prefetcher.request(layer, expert, priority)`
and gets a `Ticket`.  One daemon thread serves the request queue, synchronous
requests (the decode step is stalled on them) before background admissions,
one transfer at a time, like a single DMA engine:

  * no duplicate requests: asking again for a (layer, expert) that is queued,
    in flight, or arrived but not yet collected returns the same ticket
    (a background ticket asked for synchronously is upgraded to "sync" and
    served before the queued background ones);
  * a ticket is *collected* when `wait()` returns its arrays or
    `completed_background()` hands it out; after that a new request for the key
    is a new transfer (the engine evicted the expert and needs it again);
  * cancellation of queued tickets; clean shutdown as a context manager;
  * an exception in the thread (a store that cannot read a file, a failing
    device_put) stops the thread; it is re-raised in the caller as
    TransferError at the next wait()/request()/completed_background()/close(),
    and every queued ticket fails with it, so nothing hangs.

Link timing (moejax.offload.link): a transfer starts when it is requested or
when the link becomes free, whichever is later, and is complete no earlier
than ``start + nbytes / bandwidth + latency`` -- and no earlier than the real
`device_put` has finished.  Transfers never overlap on the link; a sync
request that arrives while a background transfer occupies the link waits for
it (no pre-emption, as with real DMA), but overtakes every queued background
one.  Meanwhile the caller's compute runs for real.

Arrays handed out are owned device buffers: on the CPU backend `device_put` of
a numpy array (or a memmap) may alias the host buffer instead of copying it;
`owned_device_put` detects this and copies.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import jax
import numpy as np

from moejax.offload.link import Link

SYNC, BACKGROUND = "sync", "background"
_PRIORITIES = (SYNC, BACKGROUND)


class TransferError(RuntimeError):
  """A failure in the prefetch thread, re-raised in the caller (cause chained)."""


class TransferCancelled(RuntimeError):
  """wait() on a ticket that was cancelled (or dropped by close())."""


# ---------------------------------------------------------------- owned copies
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
  """`jax.device_put(x, sharding)` whose result never aliases x's buffer.

  On an accelerator the put is the host->device copy itself.  On the CPU
  backend jax may wrap the numpy buffer (even a read-only memmap) or return
  the source array; then a private host copy is put instead, which only the
  returned array references.  (A numpy copy + put measured ~0.6 ms per MB
  here, against ~5 ms for an XLA copy, `jnp.array(out, copy=True)`, which
  also compiles once per shape.)
  """
  out = jax.device_put(x, sharding)
  if shares_buffer(out, x):
    out = jax.device_put(np.array(x, copy=True), sharding)
  return out


def sleep_until(deadline: float, spin_s: float = 1e-3):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop,
  since a plain sleep on a loaded machine overshoots by milliseconds."""
  while (left := deadline - time.perf_counter()) > 0:
    time.sleep(left - spin_s if left > 2 * spin_s else 0)


# ---------------------------------------------------------------------- ticket
class Ticket:
  """One (layer, expert) transfer.

  Attributes: key, priority ("sync" | "background"), requested_s, started_s
  (when it took the link), finished_s (complete: link time elapsed and real
  copy done), nbytes, wait_s (time callers spent blocked in wait()).  All
  times are `time.perf_counter()` seconds.
  """

  def __init__(self, owner: "Prefetcher", key: tuple[int, int], priority: str):
    self.key = key
    self.priority = priority
    self.requested_s = time.perf_counter()
    self.started_s: float | None = None
    self.finished_s: float | None = None
    self.nbytes = 0
    self.wait_s = 0.0
    self._owner = owner
    self._resolved = threading.Event()  # copy finished, failed or cancelled
    self._arrays: dict[str, jax.Array] | None = None
    self._error: BaseException | None = None
    self._cancelled = False

  def __repr__(self):
    state = ("cancelled" if self._cancelled else "failed" if self._error is not None
             else "arrived" if self._arrays is not None else
             "in flight" if self.started_s is not None else "queued")
    return f"Ticket(layer={self.key[0]}, expert={self.key[1]}, {self.priority}, {state})"

  def done(self) -> bool:
    """True once wait() would not block: arrived with its link time elapsed, failed, or
    cancelled."""
    if not self._resolved.is_set():
      return False
    if self._arrays is None:
      return True
    return time.perf_counter() >= self.finished_s

  def arrived(self) -> bool:
    """done() and the arrays are there (not failed, not cancelled)."""
    return self._arrays is not None and self.done()

  def cancelled(self) -> bool:
    return self._cancelled

  def wait(self, timeout: float | None = None) -> dict[str, jax.Array]:
    """Blocks until complete; returns the expert's owned device arrays.

    Raises TransferError (a failure in the thread), TransferCancelled, or
    TimeoutError after `timeout` seconds.
    """
    t0 = time.perf_counter()
    try:
      if not self._resolved.wait(timeout):
        raise TimeoutError(f"transfer of layer {self.key[0]} expert {self.key[1]} not "
                           f"complete after {timeout} s")
      if self._error is not None:
        self._owner._error_reported = True  # pylint: disable=protected-access
        if isinstance(self._error, TransferError):  # queued behind the failing transfer
          raise TransferError(f"layer {self.key[0]} expert {self.key[1]} not transferred: "
                              f"{self._error}") from self._error.__cause__
        raise TransferError(f"prefetch thread failed on layer {self.key[0]} expert "
                            f"{self.key[1]}: {type(self._error).__name__}: {self._error}"
                            ) from self._error
      if self._cancelled:
        raise TransferCancelled(f"transfer of layer {self.key[0]} expert {self.key[1]} "
                                f"was cancelled")
      left = self.finished_s - time.perf_counter()
      if left > 0:
        if timeout is not None and time.perf_counter() - t0 + left > timeout:
          time.sleep(max(0.0, timeout - (time.perf_counter() - t0)))
          raise TimeoutError(f"transfer of layer {self.key[0]} expert {self.key[1]} needs "
                             f"{left:.4f} s more link time than the {timeout} s timeout")
        sleep_until(self.finished_s)
      self._owner._collect(self)  # pylint: disable=protected-access
      return dict(self._arrays)
    finally:
      self.wait_s += time.perf_counter() - t0

  def cancel(self) -> bool:
    """Cancels a queued transfer; False if it already started (or resolved)."""
    return self._owner._cancel(self)  # pylint: disable=protected-access


# ------------------------------------------------------------------ prefetcher
class Prefetcher:
  """A request queue served by one daemon thread doing `jax.device_put`.

  Args:
    store: an ExpertStore-like object with `get(layer, expert) -> {name: array}`
      (numpy, memmap or pinned_host jax arrays).
    link: the Link whose timing transfers obey (native: no emulation).
    device: target device (default: jax.devices()[0]).
    memory_kind: target memory kind (default: the device's default memory).
  """

  def __init__(self, store, link: Link, device=None, memory_kind: str | None = None):
    self.store = store
    self.link = link
    self.device = device if device is not None else jax.devices()[0]
    kinds = [m.kind for m in self.device.addressable_memories()]
    kind = memory_kind or self.device.default_memory().kind
    if kind not in kinds:
      raise ValueError(f"memory kind {kind!r} is not offered by {self.device}; "
                       f"it offers: {', '.join(kinds)}")
    self.sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)
    self._cond = threading.Condition()
    self._queues = {SYNC: collections.deque(), BACKGROUND: collections.deque()}
    self._active: dict[tuple[int, int], Ticket] = {}   # requested, not yet collected
    self._arrived_bg: dict[tuple[int, int], Ticket] = {}  # background, arrived, uncollected
    self._stats = collections.Counter()
    self._link_free_at = 0.0
    self._error: BaseException | None = None
    self._error_reported = False
    self._closing = False
    self._thread = threading.Thread(target=self._run, name="moejax-prefetch", daemon=True)
    self._thread.start()

  # ---------------------------------------------------------------- caller side
  def request(self, layer: int, expert: int, priority: str = SYNC) -> Ticket:
    """Queues the transfer of (layer, expert), or returns its existing ticket."""
    if priority not in _PRIORITIES:
      raise ValueError(f"priority must be one of {_PRIORITIES}, got {priority!r}")
    key = (int(layer), int(expert))
    with self._cond:
      self._raise_if_failed()
      if self._closing:
        raise RuntimeError("Prefetcher is closed")
      self._stats["requests"] += 1
      self._stats[f"{priority}_requests"] += 1
      t = self._active.get(key)
      if t is not None:
        self._stats["deduplicated"] += 1
        if priority == SYNC and t.priority == BACKGROUND:
          t.priority = SYNC
          self._stats["upgraded"] += 1
          self._arrived_bg.pop(key, None)
          if t.started_s is None:  # still queued: move ahead of the background queue
            self._queues[BACKGROUND].remove(t)
            self._queues[SYNC].append(t)
        return t
      t = Ticket(self, key, priority)
      self._active[key] = t
      self._queues[priority].append(t)
      self._cond.notify_all()
      return t

  def completed_background(self) -> list[Ticket]:
    """Background tickets that arrived (link time elapsed), not yet collected.

    Each ticket is handed out once; its arrays are ready (`wait()` returns at once).
    """
    with self._cond:
      self._raise_if_failed()
      out = [t for t in self._arrived_bg.values() if t.done()]
      for t in out:
        del self._arrived_bg[t.key]
        if self._active.get(t.key) is t:
          del self._active[t.key]
      return out

  def pending(self) -> int:
    """Requests not yet collected (queued, in flight, or arrived)."""
    with self._cond:
      return len(self._active)

  def stats(self) -> dict[str, Any]:
    """Counters: requests, deduplicated, transfers, bytes, cancelled, ..., link_busy_s."""
    with self._cond:
      s = {k: 0 for k in ("requests", "sync_requests", "background_requests", "deduplicated",
                          "upgraded", "transfers", "bytes", "cancelled", "failed")}
      s.update(self._stats)
      s["link_busy_s"] = float(self._stats.get("link_busy_us", 0)) * 1e-6
      s.pop("link_busy_us", None)
      s["link"] = self.link.describe()
      return s

  def close(self, timeout: float = 60.0):
    """Cancels queued requests, joins the thread, re-raises an unreported thread error."""
    with self._cond:
      self._closing = True
      for q in self._queues.values():
        while q:
          self._drop(q.popleft(), cancelled=True)
      self._cond.notify_all()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout)
      if self._thread.is_alive():
        raise TransferError(f"prefetch thread did not stop within {timeout} s "
                            f"(a device_put is stuck)")
    with self._cond:
      if not self._error_reported:
        self._raise_if_failed()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.close()
    else:  # do not mask the exception already propagating
      try:
        self.close()
      except TransferError:
        pass
    return False

  # ------------------------------------------------------------------ internals
  def _raise_if_failed(self):
    if self._error is not None:
      first = not self._error_reported
      self._error_reported = True
      msg = (f"prefetch thread failed: {type(self._error).__name__}: {self._error}" if first
             else "prefetch thread stopped after an earlier failure")
      raise TransferError(msg) from self._error

  def _drop(self, t: Ticket, cancelled: bool, error: BaseException | None = None):
    """Resolves a ticket that will never arrive (lock held)."""
    t._cancelled = cancelled  # pylint: disable=protected-access
    t._error = error  # pylint: disable=protected-access
    if self._active.get(t.key) is t:
      del self._active[t.key]
    self._stats["cancelled" if cancelled else "failed"] += 1
    t._resolved.set()  # pylint: disable=protected-access

  def _cancel(self, t: Ticket) -> bool:
    with self._cond:
      if t.started_s is not None or t._resolved.is_set():  # pylint: disable=protected-access
        return False
      self._queues[t.priority].remove(t)
      self._drop(t, cancelled=True)
      return True

  def _collect(self, t: Ticket):
    with self._cond:
      if self._active.get(t.key) is t:
        del self._active[t.key]
      if self._arrived_bg.get(t.key) is t:
        del self._arrived_bg[t.key]

  def _next(self) -> Ticket | None:
    """The next ticket to put on the link (None: shut down).

    A sync ticket is committed at once, even while the link is still busy: it
    takes the link when it frees (``started_s``), and its real copy is done
    early, so its completion time is exactly the link model's, however late
    this thread wakes.  A background ticket is committed only once the link
    is free, so that a sync request arriving meanwhile overtakes it.
    """
    with self._cond:
      while not self._closing:
        if self._queues[SYNC]:
          t = self._queues[SYNC].popleft()
        elif self._queues[BACKGROUND]:
          now = time.perf_counter()
          if now < self._link_free_at:
            self._cond.wait(self._link_free_at - now)
            continue
          t = self._queues[BACKGROUND].popleft()
        else:
          self._cond.wait()
          continue
        t.started_s = max(t.requested_s, self._link_free_at)
        return t
      return None

  def _run(self):
    t = None
    try:
      while (t := self._next()) is not None:
        layer, expert = t.key
        src = self.store.get(layer, expert)
        nbytes = sum(int(v.nbytes) for v in src.values())
        ready_at = t.started_s + self.link.transfer_time(nbytes)
        out = {k: owned_device_put(v, self.sharding) for k, v in src.items()}
        jax.block_until_ready(out)
        with self._cond:
          t.nbytes = nbytes
          t.finished_s = max(ready_at, time.perf_counter())
          t._arrays = out  # pylint: disable=protected-access
          self._link_free_at = t.finished_s
          self._stats["transfers"] += 1
          self._stats["bytes"] += nbytes
          self._stats["link_busy_us"] += int(round((t.finished_s - t.started_s) * 1e6))
          if t.priority == BACKGROUND and self._active.get(t.key) is t:
            self._arrived_bg[t.key] = t
          t._resolved.set()  # pylint: disable=protected-access
        t = None
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the caller)
      with self._cond:
        self._error = e
        self._closing = True
        if t is not None:
          self._drop(t, cancelled=False, error=e)
        stopped = TransferError(f"prefetch thread stopped: {type(e).__name__}: {e}")
        stopped.__cause__ = e
        for q in self._queues.values():
          while q:
            self._drop(q.popleft(), cancelled=False, error=stopped)
        self._cond.notify_all()
