"""Page-cache hints for a memory-mapped store (the disk tier), from Python.

A page fault in a mapped file reads a window around the fault (the device's read-ahead: 8
MB on the VM of docs/lab/runs/2026-12-06-disk) and waits for it, then the next fault past
it does the same: an expert's block is read in a few waits one after another, with bytes
of its neighbours that nothing asked for.  `will_need` asks for a block's pages all at once
(madvise MADV_WILLNEED), so they are read together and exactly; the program's copies do the
same in `cpu_rows.will_need`.  `resident` says which pages of an array are in the page
cache (mincore), for tests and probes.  Linux and macOS; elsewhere both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np

_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)


def _libc():
  try:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    lib.madvise.argtypes = lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                                   ctypes.c_void_p]
    return lib
  except (OSError, AttributeError):
    return None


_LIBC = _libc()


def _span(a: np.ndarray) -> tuple[int, int]:
  """(page-aligned start, length) covering a's bytes (a contiguous array)."""
  start = a.ctypes.data & ~(mmap.PAGESIZE - 1)
  return start, a.ctypes.data + a.nbytes - start


def will_need(a: np.ndarray) -> None:
  """Asks the OS to read a's pages (a contiguous slice of a mapped file) into the page
  cache now, without waiting; a hint: anonymous memory or a failed call change nothing."""
  if _LIBC is None or _MADV_WILLNEED is None or a.nbytes == 0:
    return
  start, length = _span(a)
  _LIBC.madvise(start, length, _MADV_WILLNEED)


def resident(a: np.ndarray) -> np.ndarray | None:
  """Per page of a (from its page-aligned start): whether it is in the page cache, or
  None where mincore is not available."""
  if _LIBC is None or a.nbytes == 0:
    return None
  start, length = _span(a)
  vec = np.zeros(-(-length // mmap.PAGESIZE), np.uint8)
  if _LIBC.mincore(start, length, vec.ctypes.data) != 0:
    return None
  return (vec & 1).astype(bool)
