"""Building the C++ CPU kernels (`cpu_kernel` loads them): the system compiler
(``$CXX``, else c++, g++ or clang++), the instruction set ``-march=native`` resolves to
(``$MOEJAX_CPU_MARCH`` names another target, e.g. ``x86-64-v3`` for the AVX2 kernels on
an AVX-512 machine), and the library's place in ``$MOEJAX_CACHE`` (default
``~/.cache/moejax/kernels``), keyed by the sources, flags, compiler version and that
instruction set (a cache shared between machines never loads a library built for another
CPU).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess

import jax

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRCS = [os.path.join(_HERE, f) for f in ("cpu_kernel.cc", "cpu_attention.cc", "cpu_rows.cc",
                                           "cpu_host.cc", "cpu_quant.cc")]
_HEADERS = [os.path.join(_HERE, h)   # part of the build key
            for h in ("cpu_bf16.h", "cpu_dot.h", "cpu_layer.h", "cpu_pages.h", "cpu_threads.h",
                      "cpu_prefetch.h", "cpu_qact.h", "cpu_qdot.h", "cpu_kdot.h",
                      "cpu_qrows.h", "cpu_qpanel.h", "cpu_kpanel.h")]


def _march() -> str:
  return "-march=" + (os.environ.get("MOEJAX_CPU_MARCH", "").strip() or "native")


def _flags() -> list[str]:
  return ["-O3", _march(), "-std=c++17", "-shared", "-fPIC"]


class BuildError(RuntimeError):
  """The kernels cannot be built here (no compiler, or it failed)."""


def _cache_dir() -> str:
  return os.environ.get("MOEJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                     "moejax", "kernels"))


def _compiler() -> list[str]:
  """The compiler command: $CXX (may hold arguments, e.g. "ccache g++"), else the first
  of c++, g++, clang++ on the PATH."""
  env = os.environ.get("CXX", "").strip()
  if env:
    cmd = shlex.split(env)
    if shutil.which(cmd[0]) is None:
      raise BuildError(f"no C++ compiler at CXX={env!r}")
    return cmd
  for name in ("c++", "g++", "clang++"):
    if shutil.which(name):
      return [name]
  raise BuildError("no C++ compiler (c++, g++ or clang++ on the PATH; or set CXX)")


def isa_of_driver_output(text: str) -> str:
  """The target the compiler driver resolved `-march=native` to, from its `-### -E`
  output (stderr): gcc's cc1 line names `-march=<cpu>` and one -m/-mno- flag per
  extension; clang's cc1 line `-target-cpu <cpu>` and `-target-feature +/-<ext>` pairs.
  Empty when neither is there."""
  for line in text.splitlines():
    try:
      toks = shlex.split(line)
    except ValueError:
      toks = line.split()
    if "-target-cpu" in toks:                       # clang
      return " ".join(f"{t} {n}" for t, n in zip(toks, toks[1:])
                      if t in ("-target-cpu", "-target-feature", "-tune-cpu"))
    if any(t.startswith("-march=") and t != "-march=native" for t in toks):   # gcc
      return " ".join(t for t in toks if t.startswith("-m"))
  return ""


def _cpuinfo_isa() -> str:
  """The CPU's flags from /proc/cpuinfo (x86 'flags', ARM 'Features'), else the machine
  and processor names."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
          return f"{platform.machine()} cpuinfo {' '.join(sorted(val.split()))}"
  except OSError:
    pass
  return f"{platform.machine()} {platform.processor()}"


def target_isa(cxx: list[str]) -> str:
  """What `-march=native` (or $MOEJAX_CPU_MARCH) selects on this machine, as the compiler
  resolves it (`cxx -march=native -### -E -`), else the CPU's flags (/proc/cpuinfo)."""
  try:
    res = subprocess.run([*cxx, _march(), "-###", "-E", "-"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    isa = isa_of_driver_output(res.stderr)
  except (OSError, subprocess.SubprocessError):
    isa = ""
  return isa or _cpuinfo_isa()


def cache_path(sources: bytes, cxx: list[str], version: str, isa: str) -> str:
  """The library's path in the cache: a hash of the sources, flags, compiler (command
  and version), jax's version and the target instruction set."""
  key = hashlib.sha256(sources)
  for part in (*_flags(), *cxx, version, jax.__version__, isa):
    key.update(b"\0" + part.encode())
  return os.path.join(_cache_dir(), f"moejax_cpu_kernel_{key.hexdigest()[:16]}.so")


def build() -> str:
  """Compiles the kernels (once per sources/flags/compiler/ISA) and returns the .so path.

  Raises BuildError (one line; a failed compile's output goes to a .log beside the
  library) when it cannot.
  """
  cxx = _compiler()
  src = b""
  for path in _SRCS + _HEADERS:
    with open(path, "rb") as f:
      src += f.read()
  try:
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True,
                             timeout=120).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise BuildError(f"cannot run the C++ compiler {' '.join(cxx)!r}: {e}") from e
  out = cache_path(src, cxx, version, target_isa(cxx))
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  tmp = f"{out}.{os.getpid()}.tmp"
  cmd = [*cxx, *_flags(), "-I", jax.ffi.include_dir(), "-I", _HERE, *_SRCS, "-o", tmp]
  try:
    res = subprocess.run(cmd, capture_output=True, text=True)
  except OSError as e:
    raise BuildError(f"cannot run the C++ compiler {' '.join(cxx)!r}: {e}") from e
  if res.returncode != 0:
    log = out[:-len(".so")] + ".log"
    with open(log, "w") as f:
      f.write(" ".join(cmd) + "\n" + res.stdout + res.stderr)
    raise BuildError(f"{' '.join(cxx)} failed to compile them (exit {res.returncode}; "
                     f"its output is in {log})")
  os.replace(tmp, out)
  return out
