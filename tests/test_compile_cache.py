"""The programs' persistent compilation cache (moejax.cli.app.enable_compile_cache): where
it lives, how to turn it off, and that a second start of the same command reuses it."""

import os
import subprocess
import sys

import pytest

from moejax.cli import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_where_the_cache_lives(monkeypatch, tmp_path):
  for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "MOEJAX_COMPILE_CACHE"):
    monkeypatch.delenv(name, raising=False)                     # restored afterwards
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path))
  assert app.compile_cache_dir() == os.path.join(str(tmp_path), "xla")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/else")
  assert app.compile_cache_dir() == "/somewhere/else"          # jax's own variable wins
  monkeypatch.setenv("MOEJAX_COMPILE_CACHE", "0")
  assert app.compile_cache_dir() is None                        # off
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  app.enable_compile_cache()                                    # nothing to enable
  assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
  monkeypatch.delenv("MOEJAX_COMPILE_CACHE")
  app.enable_compile_cache()                                    # jax reads it at import
  assert os.environ["JAX_COMPILATION_CACHE_DIR"] == os.path.join(str(tmp_path), "xla")


def _generate(env):
  argv = [sys.executable, "-m", "launch.generate", "--policy=quality", "--cache_fraction=0.25",
          "--max_new_tokens=4", "--max_len=64", "--nostream", "--noprogress", "--link=native",
          "--prompt=def add(a, b):"]
  return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_second_start_reuses_the_compiled_programs(tmp_path):
  if not os.path.exists(os.path.join(ROOT, "ckpts", "demo", "config.json")):
    pytest.skip("no demo model at ckpts/demo")
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(MOEJAX_CACHE_DIR=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  first = _generate(env)
  assert first.returncode == 0, first.stderr[-2000:]
  cache = tmp_path / "xla"
  kept = sorted(p.name for p in cache.iterdir())
  assert kept, "nothing was kept in the compilation cache"
  second = _generate(env)
  assert second.returncode == 0, second.stderr[-2000:]
  assert second.stdout == first.stdout                          # the same greedy text
  assert sorted(p.name for p in cache.iterdir()) == kept        # loaded, nothing new compiled
