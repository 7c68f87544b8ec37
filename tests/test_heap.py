"""io.heap: glibc's mmap threshold held fixed, so that an array made anew each generation
(a KV cache, the on-device loop's records) is mapped each time instead of coming from the
heap after its first was freed (issue 62: the heap grew 8.4 MB steps over a long run).
Each case runs in a fresh process: the threshold is process state."""

import os
import platform
import subprocess
import sys

import pytest

from moejax.io import heap

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")

# An array of 2 MB made, freed and made again: is the second one mapped (malloc_info's
# `mapped`, the bytes in chunks of their own mmap, holds it)?  Prints 1 if so.
PROBE = """
import numpy as np
from moejax.io import heap
{setup}
a = np.ones(1 << 21, np.uint8)
del a                                   # glibc's dynamic rule: the threshold rises to 2 MB
before = heap.malloc_info()["mapped"]
b = np.ones(1 << 21, np.uint8)
print(int(heap.malloc_info()["mapped"] - before >= b.nbytes))
"""


def mapped_again(setup: str, **env) -> bool:
  environ = {k: v for k, v in os.environ.items()
             if k != "MALLOC_MMAP_THRESHOLD_" and k != "GLIBC_TUNABLES"}
  out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], env={**environ, **env},
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.split()[-1] == "1"


def test_the_dynamic_threshold_puts_a_freed_size_on_the_heap_and_holding_it_maps_it():
  assert not mapped_again("")                     # glibc's default: the heap, the growth
  assert mapped_again("assert heap.hold_mmap_threshold()")


def test_an_engine_holds_the_threshold():
  setup = """
import jax, jax.numpy as jnp
from moejax.cache import policy
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.model.model import Transformer
from tests import tiny_models
cfg = tiny_models.tiny_config((True, False, True))
store = tiny_models.random_store(cfg, np.random.default_rng(0), 0.2)
seq = jnp.zeros((1, 4), jnp.int32)
params = Transformer(cfg).init(jax.random.PRNGKey(0), seq, store.to_device())["params"]
OffloadEngine(cfg, params, store, EngineConfig.make(policy.make_policy("baseline"), max_len=32,
                                                   cache_fraction=0.25)).close()
"""
  assert mapped_again(setup)


def test_a_threshold_the_user_set_is_kept():
  assert heap.user_set({"MALLOC_MMAP_THRESHOLD_": "65536"})
  assert heap.user_set({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"})
  assert not heap.user_set({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
  # the user's own (fixed) threshold: nothing set here, and the fixed rule holds anyway
  setup = "assert not heap.hold_mmap_threshold()"
  assert mapped_again(setup, MALLOC_MMAP_THRESHOLD_=str(1 << 20))


def test_leave_dynamic_keeps_glibcs_rule_and_malloc_info_counts():
  assert not mapped_again("assert heap.leave_dynamic() and not heap.hold_mmap_threshold()")
  info = heap.malloc_info()
  assert set(info) == {"heap", "mapped", "in_use", "free"} and info["in_use"] > 0
