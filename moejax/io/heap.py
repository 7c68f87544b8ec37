"""glibc malloc's mmap threshold held fixed, so that the arrays an engine makes anew for
each generation do not grow the heap (issue 62: memory flat over a 20,000-token run).

glibc serves an allocation of at least its "mmap threshold" with an mmap of its own,
unmapped when freed.  The threshold starts at 128 KiB and is dynamic: freeing such a chunk
raises it to the chunk's size (up to 32 MiB), so from then on arrays of that size come from
the heap, among small allocations that split the space they leave.  An engine makes two
big arrays a generation: the prompt pass's new KV cache (8.4 MB on the demo model at 2,048
positions) and, through the on-device loop, the generation's records (8.7 MB for 2,000
tokens).  After the first of each was freed the next came from the heap, and the heap grew
in steps of 8.4 MB while malloc's own count of bytes in use stayed flat: +17 MB RssAnon over
20,000 decode steps (+23 MB over 40,000), through either link.  With the threshold fixed at
MMAP_THRESHOLD (mallopt M_MMAP_THRESHOLD, which also turns the dynamic rule off) each such
array is mapped and unmapped again: docs/lab/runs/2026-12-07-records.

MMAP_THRESHOLD is 1 MiB, not glibc's 128 KiB, so that a decode step's own buffers (the
demo's program temporaries: 207 kB) stay on the heap: at 128 KiB they were mapped anew
each step, ~85 more page faults a token on the demo.  What 1 MiB costs is the big arrays'
fresh pages: 1,000-2,000 more minor faults a generation on the demo (a few ms), none a
step.

`hold_mmap_threshold` sets it once per process (`OffloadEngine` does), and leaves alone a
threshold the user set (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in
GLIBC_TUNABLES).  Elsewhere than glibc it does nothing.  `leave_dynamic` keeps glibc's rule
for a process (the comparison run of `bench_memory --records --records_heap=dynamic`);
`malloc_info` reads malloc's own counts (mapped and in use).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 1 << 20     # bytes: arrays of this size or more are mapped
_M_MMAP_THRESHOLD = -3        # malloc.h
_held: bool | None = None     # None: not tried yet; else whether this module set it


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def _glibc():
  try:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
    lib.gnu_get_libc_version          # glibc only (musl, macOS: no such symbol)
    lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return lib
  except (OSError, AttributeError):
    return None


_LIBC = _glibc()


def user_set(environ=os.environ) -> bool:
  """Whether the environment already fixes the threshold (then it is not dynamic)."""
  return ("MALLOC_MMAP_THRESHOLD_" in environ
          or "glibc.malloc.mmap_threshold" in environ.get("GLIBC_TUNABLES", ""))


def hold_mmap_threshold() -> bool:
  """Fixes glibc's mmap threshold at MMAP_THRESHOLD for this process (once; later calls
  return the first answer).  -> whether it was set here (False: not glibc, the user's own
  setting kept, or mallopt refused)."""
  global _held
  if _held is None:
    lib = None if user_set() else _LIBC
    _held = bool(lib is not None and lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
  return _held


def held() -> bool:
  """Whether `hold_mmap_threshold` set the threshold in this process."""
  return bool(_held)


def leave_dynamic() -> bool:
  """Keeps glibc's dynamic threshold in this process: `hold_mmap_threshold` will do
  nothing.  -> False where it was held already (too late)."""
  global _held
  if _held is None:
    _held = False
  return not _held


def malloc_info() -> dict | None:
  """glibc's malloc counts (mallinfo2, every arena), in bytes: `heap` (the arenas' bytes
  from the OS), `mapped` (chunks of their own mmap), `in_use` (allocated, heap and mapped),
  `free` (the heap's free bytes); None elsewhere than glibc 2.33+."""
  fn = getattr(_LIBC, "mallinfo2", None)
  if fn is None:
    return None
  fn.restype = _MallInfo2
  m = fn()
  return {"heap": m.arena, "mapped": m.hblkhd, "in_use": m.uordblks + m.hblkhd,
          "free": m.fordblks}
