"""The quantized kernels' AVX2 build (MOEJAX_CPU_MARCH=x86-64-v3: vpmaddubsw dots, 8
lanes) on a machine that would build the AVX-512 ones: its dots run the AVX2 path and
pass tests/test_cpu_quant.py (reference, bound, a token's bits alone and in a prompt). One
subprocess: it builds the whole library for that target (about a minute on 2 cores)."""

import os
import platform
import subprocess
import sys

import pytest

from moejax.kernels import cpu_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_has_avx2() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      return any(line.startswith("flags") and " avx2" in line for line in f)
  except OSError:
    return False


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_avx2(),
                    reason="the AVX2 build runs on an x86-64 CPU with AVX2 only")
@pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ compiler: nothing is built")
def test_the_avx2_build_passes_the_quant_tests():
  env = dict(os.environ, MOEJAX_CPU_MARCH="x86-64-v3", JAX_PLATFORMS="cpu")
  isa = subprocess.run(
      [sys.executable, "-c", "from moejax.kernels import cpu_kernel as k; "
       "assert k.available(); print(k._state['lib'].moejax_qdot_isa().decode(), k.lanes())"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert isa.returncode == 0, isa.stderr[-2000:]
  assert isa.stdout.split() == ["avx2", "8"]
  res = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
       os.path.join("tests", "test_cpu_quant.py"), "-k", "not in_the_program"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
  assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1]
