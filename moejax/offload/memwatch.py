"""What a run really holds: anonymous RAM against file-backed pages, and disk reads.

The memory plan (`offload.memory`) separates anonymous memory (what the process owns:
dense parameters, slot buffers, KV cache, XLA's buffers) from the page cache (the
mapped checkpoint, which the kernel reclaims under pressure).  `/proc`'s VmHWM mixes
the two, so `AnonWatch` samples RssAnon on a thread and keeps its peak:

  with AnonWatch() as w:
    run()
  w.peak_anon, w.read_bytes    # bytes: the sampled peak of RssAnon; disk bytes read

`status()` reads the current figures once.  Linux only (elsewhere the figures are None).
"""

from __future__ import annotations

import os
import threading


def _status_kb(pid: str = "self") -> dict:
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
          out[key] = int(rest.split()[0]) * 1024
  except OSError:
    pass
  return out


def read_bytes(pid: str = "self") -> int | None:
  """Bytes this process caused to be read from storage (/proc/PID/io read_bytes)."""
  try:
    with open(f"/proc/{pid}/io") as f:
      for line in f:
        if line.startswith("read_bytes:"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def status(pid: str = "self") -> dict:
  """{rss_anon, rss_file, vm_hwm}: bytes now (VmHWM: the peak of anon + file pages)."""
  s = _status_kb(pid)
  return {"rss_anon": s.get("RssAnon"), "rss_file": s.get("RssFile"),
          "vm_hwm": s.get("VmHWM")}


class AnonWatch:
  """The peak of RssAnon, sampled every `interval_s` on a daemon thread, and the disk
  bytes read, between enter and exit (`peak_anon` also counts what was held at enter)."""

  def __init__(self, interval_s: float = 0.005, pid: str = "self"):
    self.interval_s, self.pid = interval_s, pid
    self.peak_anon = self.start_anon = self.read_bytes = None
    self._stop = threading.Event()
    self._thread = None
    self._read0 = None

  def sample(self):
    a = _status_kb(self.pid).get("RssAnon")
    if a is not None:
      self.peak_anon = a if self.peak_anon is None else max(self.peak_anon, a)
    return a

  def _loop(self):
    while not self._stop.wait(self.interval_s):
      self.sample()

  def __enter__(self):
    self.start_anon = self.sample()
    self._read0 = read_bytes(self.pid)
    self._thread = threading.Thread(target=self._loop, name="moejax-anon-watch", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.sample()
    r = read_bytes(self.pid)
    self.read_bytes = None if r is None or self._read0 is None else r - self._read0
    return False

  def as_dict(self) -> dict:
    return {"peak_anon_bytes": self.peak_anon, "start_anon_bytes": self.start_anon,
            "disk_read_bytes": self.read_bytes, **{f"{k}_bytes": v for k, v in
                                                   status(self.pid).items()}}


def gib(n) -> str:
  return "n/a" if n is None else f"{n / 1e9:.2f} GB"
