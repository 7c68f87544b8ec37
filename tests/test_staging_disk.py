"""The host staging tier on small per-expert bf16 checkpoints (tests/test_disk_tier.py's
model): the same tokens with the smallest tier as without it, a read from disk that reads
its expert's blocks and no more, and, at 64 MB of experts,
peak anonymous RSS within the plan with a 16 MB tier (a child process,
tests/disk_tier_child.py)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io import pages, staging
from moejax.io.loader import load_model
from moejax.kernels import cpu_kernel

from tests.test_disk_tier import CHILD, config, write
from tests.test_staging import greedy

MB = 10**6


@pytest.fixture(scope="module")
def ckpt_64mb(tmp_path_factory):
  return write(config(256, 160), tmp_path_factory.mktemp("ckpt64"))


@pytest.fixture(scope="module")
def ckpt_small(tmp_path_factory):
  """The same model at hidden 128, experts of 64 (6 MB of experts): quick to write."""
  return write(config(128, 64), tmp_path_factory.mktemp("ckpt6"))


def test_per_expert_checkpoint_tokens_equal(ckpt_small):
  cfg, params, store = load_model(ckpt_small, dtype=jnp.bfloat16, mmap=True, progress=False)
  # the tier's program is unrolled; without the kernels' fixed summation order XLA rounds
  # a bf16 scan body otherwise (tests/test_engine_scan.py), so compare unrolled with unrolled
  unrolled = {} if cpu_kernel.available() else {"layer_scan": False}
  base, _, _ = greedy(cfg, params, store, jnp.bfloat16, None, tokens=6, **unrolled)
  out, s, cache = greedy(cfg, params, store, jnp.bfloat16, 4 * store.expert_nbytes(), tokens=6)
  assert out == base and cache.held() == 4 and s["disk_reads"] > 0


def test_peak_anonymous_memory_within_the_plan(ckpt_64mb):
  """A 64 MB checkpoint with a 16 MB staging tier: peak anonymous RSS above the runtime's
  own is within the plan (staging included) + 400 MB (tests/test_disk_tier.py's
  tolerance: XLA's compiles)."""
  out = subprocess.run([sys.executable, CHILD, ckpt_64mb, "mmap", "0.125", "8", "0.016"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["staging_held"] <= r["staging_rows"] == int(0.016e9 // r["expert_bytes"])
  assert r["disk_reads"] > 0
  assert r["plan_cache"] + r["staging_rows"] * r["expert_bytes"] <= r["plan_anon"]
  assert r["growth"] <= r["plan_anon"] + 400 * MB, r


def _drop_from_page_cache(a: np.ndarray) -> None:
  """Evicts the file behind the mapped array a from the page cache (written back first)."""
  while not isinstance(a, np.memmap):
    a = a.base
  fd = os.open(a.filename, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def test_a_read_from_disk_reads_its_experts_blocks_and_not_their_neighbours(tmp_path):
  """A fault alone would read a window around it (the device's read-ahead), neighbours
  included; the tier asks for the expert's blocks (pages.will_need) before copying them.
  A checkpoint of its own: pages another test's engine still maps stay in the cache."""
  ckpt = write(config(128, 64), tmp_path)
  _, _, store = load_model(ckpt, dtype=jnp.bfloat16, mmap=True, progress=False)
  cache = staging.StagingCache(store, 4 * store.expert_nbytes())
  layer = store.moe_layers[1]
  stacked = store.stacked(layer)
  _drop_from_page_cache(next(iter(stacked.values())))
  if any(pages.resident(v) is None or pages.resident(v).any() for v in stacked.values()):
    pytest.skip("no mincore here, or the file system kept the pages after POSIX_FADV_DONTNEED")
  got = cache.read(layer, 5)
  for name, v in stacked.items():
    np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint16),
                                  np.asarray(v[5:6]).view(np.uint16))
    for e, want in ((5, True), (4, False), (6, False), (0, False)):
      assert pages.resident(v[e]).all() == want, (name, e)
