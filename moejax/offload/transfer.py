"""Host->device expert transfers: tickets and the prefetch thread.

The engine asks for experts with `Prefetcher.request(layer, expert, priority)`
(or `request_many`) and gets a `Ticket`.  One daemon thread serves the queue,
synchronous requests before background admissions, one transfer at a time,
like a single DMA engine:

  * no duplicate requests: asking again for a (layer, expert) that is queued,
    in flight, or arrived but not yet collected returns the same ticket (a
    background ticket asked for synchronously is upgraded to "sync");
  * a ticket is *collected* when `wait()` returns; after that a new request for
    the key is a new transfer.  Once collected, the prefetcher keeps no
    reference to it (nor to its arrays);
  * the thread copies a `request_many` group's queued experts together into
    stacked arrays of max(n, pad_to) rows (`wait_stacked`);
  * `fetch` is a synchronous request copied on the caller's thread at once;
  * cancellation of queued tickets; clean shutdown as a context manager;
  * an exception in the thread (a store that cannot read a file, a failing
    device_put) stops the thread; it is re-raised in the caller as
    TransferError, and every queued ticket fails with it, so nothing hangs;
  * waits take a timeout: a transfer that never completes raises
    TransferTimeout (a TransferError) naming its layer and expert.

Link timing is `link.LinkSchedule`'s: a ticket is done once its (possibly
pushed back) end time has passed and its real copy has finished.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import jax

from moejax.offload import copies
from moejax.offload.link import Link, LinkSchedule
from moejax.offload.tickets import BACKGROUND, SYNC, Ticket, TransferError

_PRIORITIES = (SYNC, BACKGROUND)


# ------------------------------------------------------------------ prefetcher
class Prefetcher:
  """A request queue served by one daemon thread doing `jax.device_put`.

  Args:
    store: `get(layer, expert) -> {name: array}` (numpy, memmap or pinned_host).
    link: the Link whose timing transfers obey (native: no emulation).
    device: target device (default: jax.devices()[0]).
    memory_kind: target memory kind (default: the device's default memory).
    background_chunks: pieces a background transfer takes the link in.
    host_copies: copy into private host stacks instead of device arrays (the CPU
      backend, whose device memory is host memory: the caller's jitted call takes
      the stack as an argument without copying it).  Tickets then hold numpy rows.
    wait_spin_s: the last part of a wait for link time that yields in a loop
      instead of sleeping (see `sleep_until`); inf: the whole wait.
  """

  def __init__(self, store, link: Link, device=None, memory_kind: str | None = None,
               background_chunks: int = 4, host_copies: bool = False,
               wait_spin_s: float = 2e-4):
    self.store = store
    self.link = link
    self.schedule = LinkSchedule(link, background_chunks)
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
    self._stats = collections.Counter()
    self._copying: list[Ticket] = []  # popped by the thread, being copied
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
    """`request` for several experts of one layer, in order, under one lock; the new
    tickets form a group copied together (see `wait_stacked`)."""
    if priority not in _PRIORITIES:
      raise ValueError(f"priority must be one of {_PRIORITIES}, got {priority!r}")
    with self._cond:
      out, group = self._register(layer, experts, priority, pad_to)
      self._queues[priority].extend(group)
      if group:
        self._cond.notify_all()
    return out

  def fetch(self, layer: int, experts, pad_to: int = 0) -> tuple[list[Ticket], dict | None]:
    """A synchronous fetch copied on the calling thread, at once (a caller stalled on
    the experts gains nothing from a hand-off but the thread's wake-up).

    Link time is committed now, like a queued sync request's.  Experts already
    requested (a background admission in flight) are upgraded and left to the
    thread.  Returns (tickets, rows): rows are the experts stacked [max(n, pad_to),
    ...] when this call copied every one of them, else None (use `wait_stacked`).
    The rows are handed out before the link time ends so the caller can place
    them (as a DMA engine writes straight into the slot); computing with them
    before `wait_stacked(tickets)` returns would beat the link.  A failure stops
    the prefetcher and is raised as TransferError; an interrupt (KeyboardInterrupt)
    cancels this fetch's tickets and propagates as is, the prefetcher unharmed.
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
          self.schedule.commit_sync(t, time.perf_counter())
      arrays, rows = self._copy_experts(srcs, pad_to)
    except Exception as e:  # pylint: disable=broad-except  (stop, as the thread would)
      with self._cond:
        for t in mine:
          self._drop(t, cancelled=False, error=e)
        self._fail(e)
        self._error_reported = True
      raise TransferError(f"synchronous fetch of layer {layer} expert(s) "
                          f"{[t.key[1] for t in mine]} failed: {type(e).__name__}: {e}") from e
    except BaseException:
      with self._cond:
        for t in mine:
          self._drop(t, cancelled=True)
      raise
    with self._cond:
      now = time.perf_counter()
      for t, row in zip(mine, rows):
        t._arrays, t._row = arrays, row  # pylint: disable=protected-access
        t.finished_s = max(t.finished_s, now)      # and no earlier than the real copy
        self._count_transfer(t)
        t._resolved.set()  # pylint: disable=protected-access
    return out, (arrays if len(mine) == len(out) and rows[0] is not None else None)

  def _register(self, layer: int, experts, priority: str, pad_to: int):
    """(every ticket in order, the new ones: one group), lock held; a background
    ticket asked for synchronously is upgraded and moved ahead of the background."""
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
          if t in self._queues[BACKGROUND]:
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

  def pending(self) -> int:
    """Requests not yet collected (queued, in flight, or arrived)."""
    with self._cond:
      return len(self._active)

  def held_bytes(self) -> int:
    """Bytes of expert copies the prefetcher references (uncollected tickets and
    transfers still on the link), each stacked array counted once."""
    with self._cond:
      tickets = list(self._active.values()) + self._copying + self.schedule.in_flight()
      arrays = {id(a): a for t in tickets for a in t.held_arrays().values()}
    return int(sum(a.nbytes for a in arrays.values()))

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
    """Cancels queued requests, joins the thread, re-raises an unreported thread error.

    Raises TransferError when the thread does not stop within `timeout` seconds.
    """
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
                            f"(a copy is stuck in the store or device_put)")
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
    else:  # do not mask the exception already propagating; note the close failure on it
      try:
        self.close()
      except TransferError as e:
        exc.add_note(f"while handling it, closing the prefetcher failed: {e}")
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
      self.schedule.release(t)
      t._group = None  # pylint: disable=protected-access  (only read before the copy)

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
      return copies.host_stack(srcs, pad_to), list(range(len(srcs)))
    if len(srcs) == 1 and pad_to <= 1:
      arrays = {k: copies.owned_device_put(v, self.sharding) for k, v in srcs[0].items()}
      rows = [None]
    else:
      arrays = copies.stacked_device_put(srcs, self.sharding, pad_to)
      rows = list(range(len(srcs)))
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
            self.schedule.commit_sync(t, time.perf_counter())
          else:
            self.schedule.commit_background(t, time.perf_counter())
          self._count_transfer(t)
          t._resolved.set()  # pylint: disable=protected-access  (done() once finished_s passes)
        t = None
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the caller)
      with self._cond:
        if t is not None:
          self._drop(t, cancelled=False, error=e)
        self._fail(e)
      if not isinstance(e, Exception):
        raise

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
