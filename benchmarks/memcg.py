"""A command run inside a memory cgroup (v1), and what it used: for the disk-tier benchmarks.

  res = memcg.run([...argv...], limit_bytes=12 * 10**9, timeout_s=3600)
  res.returncode, res.oom_killed, res.peak_bytes, res.peak_anon_bytes, res.read_bytes

The child starts in a fresh group under the mounted v1 memory hierarchy
(``/sys/fs/cgroup/memory``) whose ``memory.limit_in_bytes`` is the limit: anonymous memory
above it is killed by the kernel's OOM killer, file pages (the mapped checkpoint) are
reclaimed.  Peak anonymous RSS is sampled from the child's /proc status
(`offload.memory.AnonWatch`), the group's own peak (``memory.max_usage_in_bytes``) counts page cache too, and the
disk bytes read are the child's block input operations (``ru_inblock`` x 512 bytes,
from the rusage of waited children: one child at a time).

Needs root and a mounted v1 memory controller; `available()` says why not, and the
benchmarks exit 2 with that reason.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import threading
import time

ROOT = "/sys/fs/cgroup/memory"


def available() -> str | None:
  """None when memory cgroups can be used here, else the reason they cannot."""
  if not os.path.isdir(ROOT) or not os.path.exists(os.path.join(ROOT, "memory.limit_in_bytes")):
    return f"no cgroup v1 memory hierarchy mounted at {ROOT}"
  if os.geteuid() != 0:
    return "memory cgroups need root (this process is not)"
  try:
    path = os.path.join(ROOT, f"moejax-probe-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    os.rmdir(path)
  except OSError as e:
    return f"cannot create a memory cgroup under {ROOT}: {e}"
  return None


@dataclasses.dataclass
class Result:
  returncode: int
  oom_killed: bool
  wall_s: float
  peak_bytes: int | None          # the group's peak: anonymous + page cache
  peak_anon_bytes: int | None     # the child's sampled peak RssAnon
  read_bytes: int | None          # the child's disk bytes read (/proc/PID/io)
  stdout: str
  stderr: str


def _write(path: str, value):
  with open(path, "w") as f:
    f.write(str(value))


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def _oom_kills(group: str) -> int:
  try:
    with open(os.path.join(group, "memory.oom_control")) as f:
      for line in f:
        if line.startswith("oom_kill "):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


def run(argv: list[str], limit_bytes: int | None, timeout_s: float = 3600.0,
        env: dict | None = None) -> Result:
  """Runs argv in a new memory cgroup limited to `limit_bytes` (None: no limit, still
  measured) and waits; the group is removed afterwards."""
  why = available()
  if why:
    raise RuntimeError(why)
  from moejax.offload import memory as mem
  group = os.path.join(ROOT, f"moejax-{os.getpid()}-{time.monotonic_ns()}")
  os.makedirs(group)
  try:
    if limit_bytes:
      _write(os.path.join(group, "memory.limit_in_bytes"), int(limit_bytes))
    procs = os.path.join(group, "cgroup.procs")
    t0 = time.perf_counter()
    blocks0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    # the shell joins the group, then execs the command (no Python runs between fork and
    # exec: a preexec_fn would fork a multithreaded parent, e.g. one that imported jax)
    child = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watch = mem.AnonWatch(pid=str(child.pid), interval_s=0.02)
    stop = threading.Event()

    def sample():
      while not stop.wait(0.02):
        watch.sample()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
      out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      child.kill()
      out, err = child.communicate()
    stop.set()
    th.join()
    wall = time.perf_counter() - t0
    blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks0
    return Result(returncode=child.returncode, oom_killed=_oom_kills(group) > 0, wall_s=wall,
                  peak_bytes=_read_int(os.path.join(group, "memory.max_usage_in_bytes")),
                  peak_anon_bytes=watch.peak_anon, read_bytes=512 * blocks, stdout=out,
                  stderr=err)
  finally:
    for _ in range(50):          # the group empties once the child is reaped
      try:
        os.rmdir(group)
        break
      except OSError:
        time.sleep(0.1)


def drop_page_cache():
  """Writes back dirty pages and drops the page cache (root), so a run reads from disk."""
  subprocess.run(["sync"], check=False)
  try:
    _write("/proc/sys/vm/drop_caches", 3)
  except OSError:
    pass
