"""One expert transfer (`Ticket`) and the waits on tickets.

A ticket is created by `transfer.Prefetcher` for one (layer, expert); it resolves
when its copy finished (or failed, or was cancelled) and is *done* once its link
time (`link.LinkSchedule`) has also elapsed.  Every wait takes a timeout: a
transfer that never completes raises TransferTimeout naming its layer and expert.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax.numpy as jnp

SYNC, BACKGROUND = "sync", "background"


class TransferError(RuntimeError):
  """A failure in a transfer, re-raised in the caller (cause chained)."""


class TransferTimeout(TransferError):
  """A wait for a transfer that did not complete within its timeout."""


class TransferCancelled(RuntimeError):
  """wait() on a ticket that was cancelled (or dropped by close())."""


def sleep_until(deadline: float, spin_s: float = 2e-4):
  """Sleeps until perf_counter() >= deadline; the last `spin_s` yields in a loop
  (time.sleep(0) releases the GIL every turn), since a plain sleep on a loaded
  machine overshoots by milliseconds."""
  while (left := deadline - time.perf_counter()) > 0:
    time.sleep(left - spin_s if left > 2 * spin_s else 0)


# ---------------------------------------------------------------------- ticket
class Ticket:
  """One (layer, expert) transfer.

  Attributes: key, priority ("sync" | "background"), requested_s, started_s
  (when it took the link), finished_s (complete: link time elapsed and real
  copy done), nbytes, wait_s (time callers spent blocked in wait()).  All times
  are `time.perf_counter()` seconds.
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
    # the stacked arrays holding this expert (shared with its group) and its row
    self._arrays: dict[str, Any] | None = None
    self._row: int | None = None               # None: _arrays are this expert's alone
    self._group = group if group is not None else [self]   # one request_many call
    self._pad_to = pad_to
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
    return self.finished_s is None or time.perf_counter() >= self.finished_s

  def cancelled(self) -> bool:
    return self._cancelled

  def held_arrays(self) -> dict[str, Any]:
    """The arrays this ticket references (its group's stacked copy), {} if none."""
    return dict(self._arrays or {})

  def wait(self, timeout: float | None = None) -> dict[str, Any]:
    """Blocks until complete; returns the expert's owned arrays.

    Raises TransferError (a failure; TransferTimeout after `timeout` seconds) or
    TransferCancelled.
    """
    self.block(timeout)
    return self._expert()

  def _expert(self) -> dict[str, Any]:
    if self._row is None:                      # copied alone: its own arrays
      return dict(self._arrays)
    return {k: v[self._row] for k, v in self._arrays.items()}

  def _timeout(self, timeout: float, what: str) -> TransferTimeout:
    return TransferTimeout(f"transfer of layer {self.key[0]} expert {self.key[1]} ({self.priority}) "
                           f"{what} within the {timeout:g} s timeout")

  def block(self, timeout: float | None = None):
    """wait() without slicing the expert out of its stacked arrays."""
    t0 = time.perf_counter()
    try:
      if not self._resolved.wait(timeout):
        raise self._timeout(timeout, "was not copied")
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
          raise self._timeout(timeout, f"needs {left:.4f} s more link time, not complete")
        sleep_until(self.finished_s, self._owner.wait_spin_s)
      self._owner._collect(self)  # pylint: disable=protected-access
    finally:
      self.wait_s += time.perf_counter() - t0

  def cancel(self) -> bool:
    """Cancels a queued transfer; False if it already started (or resolved)."""
    return self._owner._cancel(self)  # pylint: disable=protected-access


def wait_stacked(tickets: list[Ticket], pad_to: int = 0,
                 timeout: float | None = None) -> dict[str, Any]:
  """Waits for every ticket; their experts stacked in ticket order, [max(n, pad_to), ...].

  Rows past n are unspecified.  `timeout` bounds the whole wait (`wait_all`).
  """
  wait_all(tickets, timeout)
  return stacked(tickets, pad_to)


def wait_all(tickets: list[Ticket], timeout: float | None = None):
  """Blocks until every ticket is complete (`Ticket.block`); `timeout` bounds the whole
  wait.  The link serves tickets in order: the last one is waited for first."""
  deadline = None if timeout is None else time.perf_counter() + timeout
  for t in tickets[::-1]:
    t.block(None if deadline is None else max(0.0, deadline - time.perf_counter()))


def stacked(tickets: list[Ticket], pad_to: int = 0) -> dict[str, Any]:
  """`wait_stacked` for tickets already waited for: the arrays the thread put when the
  tickets are one group in order (no device work), else rows gathered on the device."""
  n = max(len(tickets), pad_to)
  first = tickets[0]._arrays  # pylint: disable=protected-access
  if (all(t._arrays is first and t._row == j for j, t in enumerate(tickets))  # pylint: disable=protected-access
      and next(iter(first.values())).shape[0] == n):
    return first
  per = [t._expert() for t in tickets]  # pylint: disable=protected-access
  return {k: jnp.stack([p[k] for p in per] + [jnp.zeros_like(per[0][k])] * (n - len(per)))
          for k in per[0]}
