"""The host staging tier (`io.staging`, --store=mmap --host_cache_gb) on the demo model:
the same tokens as without it, a pool of exactly the whole experts G holds, frequency
admission, the plan's "host staging" line and the usage errors (the 64 MB per-expert
checkpoint: tests/test_staging_disk.py)."""

import os
import subprocess
import sys

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io import staging
from moejax.io.loader import load_model
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.offload.memory import plan_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")


@pytest.fixture(scope="module")
def demo():
  return load_model(DEMO, dtype=jnp.float32, mmap=True, progress=False)


def greedy(cfg, params, store, dtype, host_cache_bytes, tokens=8, **kw):
  conf = EngineConfig.make("quality", cache_fraction=0.25, max_len=64, link="native",
                           dtype=dtype, host_cache_bytes=host_cache_bytes, **kw)
  with OffloadEngine(cfg, params, store, conf) as eng:
    lg, out = eng.prefill(list(range(1, 9))), []
    for _ in range(tokens):
      out.append(int(np.argmax(lg)))
      lg = eng.decode_step(out[-1])
    return out, eng.stats(), eng.staging


def test_demo_tokens_equal_with_and_without_the_staging_tier(demo):
  cfg, params, store = demo
  ebytes = store.expert_nbytes()
  base, _, none = greedy(cfg, params, store, jnp.float32, None)
  assert none is None
  out, s, cache = greedy(cfg, params, store, jnp.float32, 120 * ebytes + ebytes // 2)
  assert out == base
  assert cache.rows == 120 and cache.held() == 120        # whole experts, filled
  assert sum(p.nbytes for p in cache.pool.values()) == 120 * ebytes
  assert s["disk_reads"] > 0 and s["staged_reads"] > 0   # read from the file, and staged


def test_reads_are_the_store_rows_and_the_pool_never_exceeds_its_rows(demo):
  _, _, store = demo
  cache = staging.StagingCache(store, 9 * store.expert_nbytes())
  rng = np.random.default_rng(0)
  hot = (store.moe_layers[1], 5)
  for i in range(400):
    l, e = hot if i % 3 == 0 else (int(rng.choice(store.moe_layers)), int(rng.integers(64)))
    got = cache.read(l, e)
    for k, v in store.stacked(l).items():
      chex.assert_trees_all_equal(got[k], np.asarray(v[e:e + 1]))
    assert cache.held() <= cache.rows == 9
  assert hot[1] in cache.staged(hot[0])         # the frequent expert stays staged
  c = cache.counts()
  assert c["staged_reads"] + c["disk_reads"] == 400 and c["staged_reads"] >= 133 - 1
  assert c["disk_bytes"] == c["disk_reads"] * store.expert_nbytes()


def test_plan_has_a_host_staging_tier_of_whole_experts(demo):
  cfg = demo[0]
  off = plan_memory(cfg, jnp.float32, store="mmap", kv_len=64, platform="gpu")
  on = plan_memory(cfg, jnp.float32, store="mmap", kv_len=64, platform="gpu", host_cache_gb=0.001)
  rows = int(0.001 * 1e9 // on.expert_bytes)
  assert on.host_cache_bytes == rows * on.expert_bytes == on.host_bytes
  assert on.anon_bytes == off.anon_bytes + on.host_cache_bytes
  assert any(line.startswith("host RAM") and f"host staging (--host_cache_gb: {rows} experts"
             in line for line in on.lines())
  small = staging.smallest_gb(on.expert_bytes, on.num_moe_layers)
  plan_memory(cfg, jnp.float32, store="mmap", kv_len=64, host_cache_gb=small)   # works
  with pytest.raises(staging.StagingError, match=rf"--host_cache_gb=0.0001 holds 2 experts .* "
                     rf"smallest that works is --host_cache_gb={small:.2f}"):
    plan_memory(cfg, jnp.float32, store="mmap", kv_len=64, host_cache_gb=0.0001)
  with pytest.raises(staging.StagingError, match="needs --store=mmap"):
    plan_memory(cfg, jnp.float32, store="numpy", kv_len=64, host_cache_gb=1.0)


def _generate(*args):
  p = subprocess.run([sys.executable, "-m", "launch.generate", "--policy=quality", *args],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  return p.returncode, p.stderr


@pytest.mark.parametrize("args,needles", [
    (["--store=mmap", "--host_cache_gb=0.0001"], ["--host_cache_gb=0.0001 holds 2 experts",
                                                   "smallest that works is --host_cache_gb=0.01"]),
    (["--host_cache_gb=1"], ["--host_cache_gb", "needs --store=mmap"]),
])
def test_cli_usage_errors_before_loading(args, needles):
  rc, err = _generate("--dry_run", *args)
  lines = err.strip().splitlines()
  assert rc == 2 and "Traceback" not in err, err
  assert lines[0].startswith("python -m launch.generate: error: ") and len(lines) == 2, err
  assert all(n in lines[0] for n in needles), err


def test_dry_run_prints_the_staging_tier():
  rc, err = _generate("--dry_run", "--store=mmap", "--host_cache_gb=0.01")
  assert rc == 0, err
  assert "host staging (--host_cache_gb: 203 experts x 49.2 kB" in err, err


def test_time_model_prices_staged_fetches_at_the_link_and_the_rest_at_the_disk():
  from moejax.offload import hardware
  from moejax.research import timemodel
  shape, hw, disk = (hardware.model_shape(hardware.DEFAULT_MODEL), hardware.hardware("rtx3090"),
                     hardware.hardware("rtx3090_nvme"))
  tp = timemodel.roofline(hw, shape)
  assert timemodel.through_staging(tp, disk, shape.expert_bytes, 1.0).transfer_s == tp.transfer_s
  half = timemodel.through_staging(tp, disk, shape.expert_bytes, 0.5)
  read = shape.expert_bytes / disk.link_Bps + disk.link_latency_s
  assert half.transfer_s == pytest.approx(tp.transfer_s + 0.5 * read)
  assert half.low_ratio * half.transfer_s == pytest.approx(tp.low_ratio * tp.transfer_s)
  steps = np.zeros((4, shape.moe_layers, len(timemodel.STEP_FIELDS)), np.float32)
  steps[..., timemodel.STEP_FIELDS.index("fetches")] = 2.0
  slow, fast = (timemodel.time_per_token(steps, p) for p in (half, tp))
  np.testing.assert_allclose(slow - fast, 2 * shape.moe_layers * 0.5 * read, rtol=1e-3)


def test_replay_counts_what_the_tier_serves_and_the_simulator_reports_it():
  # 0, 0 hit; 2 replaces 1 (1's count has decayed below 2's), so 1 misses again
  assert staging.replay([0, 1, 0, 0, 2, 1], rows=2, num_keys=3) == (2, 6)
  assert staging.replay([0, 0, 1, 2, 0], rows=1, num_keys=3) == (2, 5)       # 0 stays
  assert staging.replay([0, 1, 2, 0, 1, 2], rows=3, num_keys=3) == (3, 6)
  assert staging.replay([0, 1, 2, 0, 1, 2], rows=1, num_keys=3)[0] < 3
  from moejax.research import simulator
  from moejax.model.config import ModelConfig
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, num_experts=16, top_k=2,
                    moe_intermediate_size=8, intermediate_size=64, sparse_layers=(True,) * 2,
                    qk_norm="head").validate()
  logits = np.random.default_rng(0).normal(size=(40, 2, 16)).astype(np.float32)
  res = simulator.simulate(cfg, logits, ["fetch_all"], cache_fraction=0.25, detail=True)[0]
  fetches = int(res.total("fetches"))
  everything = res.staging_hit_rate(rows=32, num_experts=16)      # every expert fits
  assert fetches > 0 and 0 < everything and res.staging_hit_rate(2, 16) <= everything
  distinct = len({(l, e) for t in range(res.detail["ids"].shape[0]) for l in range(2)
                  for e, a in zip(res.detail["ids"][t, l], res.detail["action"][t, l]) if a == 1}
                 | {(l, e) for t in range(res.detail["admit"].shape[0]) for l in range(2)
                    for e in res.detail["admit"][t, l] if e >= 0})
  reads = fetches + int(res.total("admissions"))
  assert everything == pytest.approx((reads - distinct) / reads)   # all but first reads hit
