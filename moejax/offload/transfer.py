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
  * `request_many` asks for several experts of one layer at once (one lock, one
    wake-up); the thread copies every still-queued expert of such a group in
    one stacked `device_put` ([max(n, pad_to), ...] per array), so a layer's
    fetches arrive as one array per weight that the engine inserts with one
    argument per weight (`wait_stacked`).  The link timing stays per ticket;
  * `fetch` is a synchronous request copied on the caller's thread at once (its
    link time committed like a queued sync request's): a caller stalled on the
    experts gains nothing from a hand-off but the thread's wake-up;
  * cancellation of queued tickets; clean shutdown as a context manager;
  * an exception in the thread (a store that cannot read a file, a failing
    device_put) stops the thread; it is re-raised in the caller as
    TransferError at the next wait()/request()/completed_background()/close(),
    and every queued ticket fails with it, so nothing hangs.

Link timing (moejax.offload.link): a transfer starts when it is requested or
when the link becomes free, whichever is later, and is complete no earlier
than ``start + nbytes / bandwidth + latency`` -- and no earlier than the real
copy has finished.  Transfers never overlap on the link.  A background
transfer takes the link in `background_chunks` pieces (default 4); a sync
transfer committed meanwhile waits for the piece on the link (no pre-emption
within a piece, as with real DMA) and overtakes the rest and every queued
background transfer, which all resume after it.  The thread copies a transfer
as soon as it is its turn and commits its link time to this model (a sync one
when it is copied, `fetch` when it is asked for); the model is computed, not
slept through, so no thread wakes at piece boundaries, and a ticket is done
once its (possibly pushed back) end time has passed.  Meanwhile the caller's
compute runs for real.

Arrays handed out are owned device buffers: on the CPU backend `device_put` of
a numpy array (or a memmap) may alias the host buffer instead of copying it;
`owned_device_put` detects this and copies.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
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


@functools.lru_cache(maxsize=None)
def _to_device(sharding: jax.sharding.Sharding, rows: int):
  """Host stack [n, ...] -> device arrays [rows, ...] (zero rows appended on the device)."""
  def pad(tree):
    return {k: jnp.concatenate([v, jnp.zeros((rows - v.shape[0],) + v.shape[1:], v.dtype)])
            if v.shape[0] < rows else v for k, v in tree.items()}
  return jax.jit(pad, out_shardings=sharding)


def _aligned_zeros(shape, dtype, align: int = 64) -> np.ndarray:
  """np.zeros in a buffer aligned to `align` bytes: XLA CPU takes such a buffer as a
  jit argument without copying it (a 16-byte aligned one is copied first)."""
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = np.zeros(nbytes + align, np.uint8)
  off = -raw.ctypes.data % align
  return raw[off:off + nbytes].view(dtype).reshape(shape)


def _host_stack(srcs: list[dict], pad_to: int = 0) -> dict[str, np.ndarray]:
  """Experts {name: host array} stacked into private, 64-byte aligned host arrays
  [max(n, pad_to), ...] (zero rows past n)."""
  n = max(len(srcs), pad_to)
  out = {}
  for k, v in srcs[0].items():
    v = np.asarray(v)
    out[k] = _aligned_zeros((n,) + v.shape, v.dtype)
    for j, src in enumerate(srcs):
      out[k][j] = src[k]
  return out


def stacked_device_put(srcs: list[dict], sharding: jax.sharding.Sharding,
                       pad_to: int = 0) -> dict[str, jax.Array]:
  """Experts {name: array} stacked into owned device arrays [max(len(srcs), pad_to), ...].

  Numpy (or memmap) sources are stacked into a private host array first, which
  the device copy may alias but never the store's buffers; only the n real rows
  cross, the zero rows past them are written on the device.  Into device memory
  the copy is a jitted call: its argument transfer costs ~30 us here against
  ~100 us for `jax.device_put` of the same two arrays (CPU backend, jax 0.10);
  it compiles once per (n, rows) -- `OffloadEngine.warmup` compiles them all.
  jax sources (a pinned_host store) are put, then stacked on the device.
  """
  n = max(len(srcs), pad_to)
  if all(isinstance(v, np.ndarray) for src in srcs for v in src.values()):
    host = {k: np.stack([src[k] for src in srcs]) for k in srcs[0]}
    if sharding.memory_kind in (None, next(iter(sharding.device_set)).default_memory().kind):
      return _to_device(sharding, n)(host)
    return jax.device_put({k: np.concatenate([v, np.zeros((n - len(srcs),) + v.shape[1:],
                                                          v.dtype)]) for k, v in host.items()},
                          sharding)
  dev = jax.device_put(srcs, sharding)
  return {k: jnp.concatenate([jnp.stack([d[k] for d in dev]),
                              jnp.zeros((n - len(dev),) + dev[0][k].shape, dev[0][k].dtype)])
          .astype(dev[0][k].dtype) for k in dev[0]}


def sleep_until(deadline: float, spin_s: float = 2e-4):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop
  (time.sleep(0): the GIL is released every turn), since a plain sleep on a
  loaded machine overshoots by milliseconds."""
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

  def __init__(self, owner: "Prefetcher", key: tuple[int, int], priority: str,
               group: "list[Ticket] | None" = None, pad_to: int = 0):
    self.key = key
    self.priority = priority
    self.requested_s = time.perf_counter()
    self.started_s: float | None = None
    self.finished_s: float | None = None
    self.nbytes = 0
    self.wait_s = 0.0
    self._owner = owner
    self._resolved = threading.Event()  # copy finished, failed or cancelled
    # the stacked device arrays holding this expert (shared with its group) and its row
    self._arrays: dict[str, jax.Array] | None = None
    self._row: int | None = None               # None: _arrays are this expert's alone
    self._group = group if group is not None else [self]   # one request_many call
    self._pad_to = pad_to
    # the link model (lock held): link time done before the transfer last (re)took the
    # link, when that was, and the whole link time
    self._done_link = 0.0
    self._resume_s = 0.0
    self._total_s = 0.0
    self._error: BaseException | None = None
    self._cancelled = False

  def __repr__(self):
    state = ("cancelled" if self._cancelled else "failed" if self._error is not None
             else "arrived" if self._resolved.is_set() else
             "in flight" if self.started_s is not None else "queued")
    return f"Ticket(layer={self.key[0]}, expert={self.key[1]}, {self.priority}, {state})"

  def done(self) -> bool:
    """True once wait() would not block: arrived with its link time elapsed, failed, or
    cancelled."""
    if not self._resolved.is_set():
      return False
    if self.finished_s is None:                # failed or cancelled
      return True
    return time.perf_counter() >= self.finished_s

  def arrived(self) -> bool:
    """done() and the arrays are there (not failed, not cancelled)."""
    return self.done() and self.finished_s is not None and not self._cancelled

  def cancelled(self) -> bool:
    return self._cancelled

  def wait(self, timeout: float | None = None) -> dict[str, jax.Array]:
    """Blocks until complete; returns the expert's owned device arrays.

    Raises TransferError (a failure in the thread), TransferCancelled, or
    TimeoutError after `timeout` seconds.
    """
    self._block(timeout)
    return self._expert()

  def _expert(self) -> dict[str, jax.Array]:
    if self._row is None:                      # copied alone: its own arrays
      return dict(self._arrays)
    return {k: v[self._row] for k, v in self._arrays.items()}

  def _block(self, timeout: float | None = None):
    """wait() without slicing the expert out of its stacked arrays."""
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
      # a background transfer's end moves later when a sync transfer takes the link
      while (left := self.finished_s - time.perf_counter()) > 0:
        if timeout is not None and time.perf_counter() - t0 + left > timeout:
          time.sleep(max(0.0, timeout - (time.perf_counter() - t0)))
          raise TimeoutError(f"transfer of layer {self.key[0]} expert {self.key[1]} needs "
                             f"{left:.4f} s more link time than the {timeout} s timeout")
        sleep_until(self.finished_s, self._owner.wait_spin_s)
      self._owner._collect(self)  # pylint: disable=protected-access
    finally:
      self.wait_s += time.perf_counter() - t0

  def cancel(self) -> bool:
    """Cancels a queued transfer; False if it already started (or resolved)."""
    return self._owner._cancel(self)  # pylint: disable=protected-access


def wait_stacked(tickets: list[Ticket], pad_to: int = 0) -> dict[str, jax.Array]:
  """Waits for every ticket; their experts stacked in ticket order, [max(n, pad_to), ...].

  Rows past n are unspecified.  When the tickets are one `request_many` group in
  order (the usual case) this returns the arrays the thread put, with no device
  work; otherwise the rows are gathered on the device.  The link serves tickets
  in order, so waiting for the last one first blocks (and sleeps) once.
  """
  for t in tickets[::-1]:
    t._block()  # pylint: disable=protected-access
  return stacked(tickets, pad_to)


def stacked(tickets: list[Ticket], pad_to: int = 0) -> dict[str, jax.Array]:
  """`wait_stacked` for tickets already waited for (no second wait)."""
  n = max(len(tickets), pad_to)
  first = tickets[0]._arrays  # pylint: disable=protected-access
  if (all(t._arrays is first and t._row == j for j, t in enumerate(tickets))  # pylint: disable=protected-access
      and next(iter(first.values())).shape[0] == n):
    return first
  per = [t._expert() for t in tickets]  # pylint: disable=protected-access
  return {k: jnp.stack([p[k] for p in per] + [jnp.zeros_like(per[0][k])] * (n - len(per)))
          for k in per[0]}


# ------------------------------------------------------------------ prefetcher
class Prefetcher:
  """A request queue served by one daemon thread doing `jax.device_put`.

  Args:
    store: an ExpertStore-like object with `get(layer, expert) -> {name: array}`
      (numpy, memmap or pinned_host jax arrays).
    link: the Link whose timing transfers obey (native: no emulation).
    device: target device (default: jax.devices()[0]).
    memory_kind: target memory kind (default: the device's default memory).
    host_copies: copy into private host stacks instead of device arrays, for the
      CPU backend, whose device memory is host memory: the copy is a memcpy with
      no device call on the thread (one would run in turn with the caller's
      device work), and the caller's jitted call takes the stack as an argument,
      which XLA CPU wraps without copying.  Tickets then hold numpy rows.
    wait_spin_s: the last part of a wait for link time that yields in a loop
      instead of sleeping (see `sleep_until`); inf: the whole wait, for a caller
      whose next device call would otherwise pay the idle CPU's wake-up.
  """

  def __init__(self, store, link: Link, device=None, memory_kind: str | None = None,
               background_chunks: int = 4, host_copies: bool = False,
               wait_spin_s: float = 2e-4):
    if background_chunks < 1:
      raise ValueError(f"background_chunks must be >= 1, got {background_chunks}")
    self.store = store
    self.link = link
    self.background_chunks = int(background_chunks)
    self.host_copies = bool(host_copies)
    self.wait_spin_s = float(wait_spin_s)
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
    self._link_free_at = 0.0         # end of every committed transfer
    self._sync_free_at = 0.0         # end of the last committed sync transfer
    self._bgs: list[Ticket] = []     # committed background transfers, in link order
    self._copying: list[Ticket] = [] # popped by the thread, being copied
    self._error: BaseException | None = None
    self._error_reported = False
    self._closing = False
    self._thread = threading.Thread(target=self._run, name="moejax-prefetch", daemon=True)
    self._thread.start()

  # ---------------------------------------------------------------- caller side
  def request(self, layer: int, expert: int, priority: str = SYNC) -> Ticket:
    """Queues the transfer of (layer, expert), or returns its existing ticket."""
    return self.request_many(layer, [expert], priority)[0]

  def request_many(self, layer: int, experts, priority: str = SYNC,
                   pad_to: int = 0) -> list[Ticket]:
    """`request` for several experts of one layer, in order, under one lock.

    The new tickets form a group: the thread copies the group's queued experts
    together into stacked arrays of max(n, pad_to) rows (see `wait_stacked`).
    """
    if priority not in _PRIORITIES:
      raise ValueError(f"priority must be one of {_PRIORITIES}, got {priority!r}")
    with self._cond:
      out, group = self._register(layer, experts, priority, pad_to)
      for t in group:
        self._queues[priority].append(t)
      if group:
        self._cond.notify_all()
    return out

  def fetch(self, layer: int, experts, pad_to: int = 0) -> tuple[list[Ticket], dict | None]:
    """A synchronous fetch copied on the calling thread, at once.

    The caller is stalled on these experts, so handing them to the prefetch
    thread would only add its wake-up (measured ~0.2 ms on a 2-vCPU VM, more than
    the copy).  Their link time is committed now, like a queued sync request's:
    after the piece of background transfer on the link, before everything queued.
    Experts already requested (a background admission in flight) are upgraded
    and left to the thread, as `request_many` does.

    Returns (tickets, rows): rows are the experts stacked [max(n, pad_to), ...]
    when this call copied every one of them, else None (use `wait_stacked`); with
    `host_copies` they are a private host stack, for a caller that passes them
    straight to its jitted insert (one call instead of a copy call and an insert).
    The rows are handed out before the link time ends so the caller can place
    them (a DMA engine writes straight into the destination slot); computing
    with them before `wait_stacked(tickets)` returns would beat the link.
    A failure stops the prefetcher, as one in the thread does, and is raised
    here as TransferError.
    """
    with self._cond:
      out, mine = self._register(layer, experts, SYNC, pad_to)
    if not mine:
      return out, None
    try:
      srcs = [self.store.get(t.key[0], t.key[1]) for t in mine]
      nbytes = [sum(int(v.nbytes) for v in src.values()) for src in srcs]
      with self._cond:
        for t, nb in zip(mine, nbytes):
          t.nbytes = nb
          self._commit_sync(t, time.perf_counter())
      arrays, rows = self._copy_experts(srcs, pad_to)
    except BaseException as e:  # pylint: disable=broad-except  (stop, as the thread would)
      with self._cond:
        for t in mine:
          self._drop(t, cancelled=False, error=e)
        self._fail(e)
        self._error_reported = True
      raise TransferError(f"synchronous fetch of layer {layer} expert(s) "
                          f"{[t.key[1] for t in mine]} failed: {type(e).__name__}: {e}") from e
    with self._cond:
      now = time.perf_counter()
      for t, row in zip(mine, rows):
        t._arrays, t._row = arrays, row  # pylint: disable=protected-access
        t.finished_s = max(t.finished_s, now)      # and no earlier than the real copy
        self._count_transfer(t)
        t._resolved.set()  # pylint: disable=protected-access
    return out, (arrays if len(mine) == len(out) and rows[0] is not None else None)

  def _register(self, layer: int, experts, priority: str, pad_to: int):
    """New tickets for the experts not already requested (lock held); the others'
    tickets, a background one upgraded when asked for synchronously.  Returns
    (every ticket in order, the new ones: one group)."""
    self._raise_if_failed()
    if self._closing:
      raise RuntimeError("Prefetcher is closed")
    out, group = [], []
    for expert in experts:
      key = (int(layer), int(expert))
      self._stats["requests"] += 1
      self._stats[f"{priority}_requests"] += 1
      t = self._active.get(key)
      if t is not None:
        self._stats["deduplicated"] += 1
        if priority == SYNC and t.priority == BACKGROUND:
          t.priority = SYNC
          self._stats["upgraded"] += 1
          self._arrived_bg.pop(key, None)
          if t in self._queues[BACKGROUND]:           # queued: ahead of the background
            self._queues[BACKGROUND].remove(t)
            self._queues[SYNC].append(t)
            self._cond.notify_all()
        out.append(t)
        continue
      t = Ticket(self, key, priority, group, pad_to)
      group.append(t)
      self._active[key] = t
      out.append(t)
    return out, group

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
      if (t.started_s is not None or t in self._copying
          or t._resolved.is_set()):  # pylint: disable=protected-access
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
    """The next ticket to copy: sync before background (None: shut down)."""
    with self._cond:
      while not self._closing:
        for q in (self._queues[SYNC], self._queues[BACKGROUND]):
          if q:
            t = q.popleft()
            self._copying.append(t)
            return t
        self._cond.wait()
      return None

  def _commit_sync(self, t: Ticket, at: float):
    """Puts sync ticket t (nbytes known) on the link model (lock held).

    t takes the link at the first moment >= `at` when no earlier sync transfer holds
    it and the background transfer on it reaches the end of one of its
    `background_chunks` pieces (no pre-emption within a piece, as with real DMA, and
    none for a background transfer upgraded to sync); every background transfer not
    finished by then resumes after t, in order.  The model is computed here, so no
    thread has to wake at piece boundaries.
    """
    total = self.link.transfer_time(t.nbytes)
    self._bgs = [b for b in self._bgs if b.finished_s > at]
    start = max(at, self._sync_free_at)
    for b in self._bgs:
      if b._resume_s <= start < b.finished_s:  # pylint: disable=protected-access  (on the link)
        piece = b._total_s / self.background_chunks  # pylint: disable=protected-access
        done = b._done_link + (start - b._resume_s)  # pylint: disable=protected-access
        edge = min(b._total_s, math.ceil(done / piece - 1e-9) * piece)  # pylint: disable=protected-access
        if b.priority == SYNC or edge >= b._total_s:  # pylint: disable=protected-access
          start = b.finished_s
        else:
          start = b._resume_s + (edge - b._done_link)  # pylint: disable=protected-access
          b._done_link = edge  # pylint: disable=protected-access
        break
    t.started_s = start
    t.finished_s = start + total
    cursor = t.finished_s
    for b in self._bgs:                 # the unfinished background transfers, after t
      if b.finished_s <= start:
        continue
      if b._resume_s > start and b._done_link == 0.0:  # pylint: disable=protected-access  (not begun)
        b.started_s = max(cursor, b.requested_s)
        b._resume_s = b.started_s  # pylint: disable=protected-access
      else:
        b._resume_s = cursor  # pylint: disable=protected-access
      b.finished_s = b._resume_s + (b._total_s - b._done_link)  # pylint: disable=protected-access
      cursor = b.finished_s
    self._sync_free_at = t.finished_s
    self._link_free_at = max(self._link_free_at, cursor)

  def _commit_background(self, t: Ticket):
    """Puts copied background ticket t on the link model after everything committed
    (lock held); later sync transfers may split it (see _commit_sync)."""
    t._total_s = self.link.transfer_time(t.nbytes)  # pylint: disable=protected-access
    t.started_s = max(t.requested_s, self._link_free_at)
    t._resume_s, t._done_link = t.started_s, 0.0  # pylint: disable=protected-access
    t.finished_s = max(t.started_s + t._total_s, time.perf_counter())  # pylint: disable=protected-access
    self._link_free_at = t.finished_s
    self._bgs.append(t)

  def _count_transfer(self, t: Ticket):
    self._stats["transfers"] += 1
    self._stats["bytes"] += t.nbytes
    self._stats["link_busy_us"] += int(round(max(self.link.transfer_time(t.nbytes),
                                                  t.finished_s - t.started_s) * 1e6))

  def _copy_experts(self, srcs: list[dict], pad_to: int):
    """The real copy of experts `srcs` (outside the lock): (arrays, rows), rows[j] the
    row of expert j in the arrays -- a private host stack with `host_copies`, else one
    expert's own device arrays (rows [None]) or stacked device arrays."""
    if self.host_copies:
      return _host_stack(srcs, pad_to), list(range(len(srcs)))
    if len(srcs) == 1 and pad_to <= 1:
      arrays, rows = {k: owned_device_put(v, self.sharding) for k, v in srcs[0].items()}, [None]
    else:
      arrays, rows = stacked_device_put(srcs, self.sharding, pad_to), list(range(len(srcs)))
    jax.block_until_ready(arrays)
    return arrays, rows

  def _copy(self, t: Ticket):
    """The real copy of t and of every still-queued, uncopied ticket of its group."""
    with self._cond:
      queued = set(map(id, self._queues[SYNC])) | set(map(id, self._queues[BACKGROUND]))
      members = [m for m in t._group  # pylint: disable=protected-access
                 if m is t or (id(m) in queued and m._arrays is None)]  # pylint: disable=protected-access
    srcs = [self.store.get(t.key[0], m.key[1]) for m in members]
    arrays, rows = self._copy_experts(srcs, t._pad_to)  # pylint: disable=protected-access
    with self._cond:
      for m, src, row in zip(members, srcs, rows):
        m.nbytes = sum(int(v.nbytes) for v in src.values())
        m._arrays, m._row = arrays, row  # pylint: disable=protected-access

  def _run(self):
    t = None
    try:
      while (t := self._next()) is not None:
        if t._arrays is None:  # pylint: disable=protected-access  (else copied with its group)
          self._copy(t)
        with self._cond:
          self._copying.remove(t)
          if t._resolved.is_set():  # pylint: disable=protected-access  (dropped by close())
            continue
          if t.priority == SYNC:
            self._commit_sync(t, time.perf_counter())
          else:
            self._commit_background(t)
            if self._active.get(t.key) is t:
              self._arrived_bg[t.key] = t
          self._count_transfer(t)
          t._resolved.set()  # pylint: disable=protected-access  (done() once finished_s passes)
        t = None
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the caller)
      with self._cond:
        if t is not None:
          self._drop(t, cancelled=False, error=e)
        self._fail(e)

  def _fail(self, e: BaseException):
    """Stops after failure `e` (lock held): every queued or in-flight ticket fails,
    the thread exits, the next call raises TransferError."""
    self._error = e
    self._closing = True
    stopped = TransferError(f"prefetch thread stopped: {type(e).__name__}: {e}")
    stopped.__cause__ = e
    for q in self._queues.values():
      while q:
        self._drop(q.popleft(), cancelled=False, error=stopped)
    for t in self._copying:
      if not t._resolved.is_set():  # pylint: disable=protected-access
        self._drop(t, cancelled=False, error=stopped)
    self._cond.notify_all()
