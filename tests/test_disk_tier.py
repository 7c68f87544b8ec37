"""The disk tier (--store=mmap) at a size where copies show: the experts stay in the mapped
file, the run keeps to its memory plan, and it completes in a memory cgroup smaller than
the checkpoint (where cgroups are available).  Each run is a child process
(tests/disk_tier_child.py), so its anonymous RSS is its own."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io import loader, placement, repack
from moejax.io.loader import init_random, load_model, save_hf
from moejax.io.store import shares_buffer
from moejax.kernels import cpu_kernel
from moejax.model.config import ModelConfig
from moejax.offload import decode
from moejax.offload.engine import EngineConfig, OffloadEngine

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disk_tier_child.py")
MB = 10**6


def config(hidden: int, inter: int) -> ModelConfig:
  """Qwen3-MoE, 4 layers of 64 experts top-8: the store is 4 x 64 x 3 x hidden x inter bf16."""
  return ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=hidden, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=64, num_experts=64, top_k=8,
                     moe_intermediate_size=inter, intermediate_size=4 * hidden,
                     sparse_layers=(True,) * 4, qk_norm="head").validate()


def write(cfg, path) -> str:
  params, exps = init_random(cfg, seed=0, dtype=jnp.bfloat16)
  save_hf(cfg, params, exps, str(path), dtype=jnp.bfloat16, layout="per_expert")
  return str(path)


@pytest.fixture(scope="module")
def ckpt_64mb(tmp_path_factory):
  """A per-expert bf16 checkpoint with 63 MB of experts (hidden 256, experts of 160)."""
  return write(config(256, 160), tmp_path_factory.mktemp("ckpt64"))


def child(model_dir, store, fraction=0.125, tokens=8, limit=None):
  argv = [sys.executable, CHILD, model_dir, store, str(fraction), str(tokens)]
  if limit is None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
  from benchmarks import memcg
  r = memcg.run(argv, limit, timeout_s=600)
  assert r.returncode == 0 and not r.oom_killed, (r.returncode, r.oom_killed, r.stderr[-3000:])
  return json.loads(r.stdout.strip().splitlines()[-1]), r


def test_the_program_reads_the_mapped_file_in_place(ckpt_64mb):
  """--store=mmap: every program-store array the decode program reads wraps the mapped
  file (no copy), laid out by the repack on 4096-byte boundaries."""
  cfg, _, store = load_model(ckpt_64mb, dtype=jnp.bfloat16, mmap=True)
  host, pinned = placement.program_store(store, jax.devices()[0])
  assert not pinned
  for l in store.moe_layers:
    for name, v in store.stacked(l).items():
      assert isinstance(v, np.memmap) and repack.aligned(v)
      assert shares_buffer(host[l][name], np.asarray(v).view(np.uint16)), (l, name)


def test_mmap_engine_keeps_the_store_out_of_anonymous_memory(ckpt_64mb):
  """The same run with the store in RAM (numpy) and mapped (mmap): the mapped run's
  anonymous growth is smaller by at least 75% of the store, i.e. what the mapped store
  adds to anonymous memory is under 25% of its size (the engine's own slots, compile
  and runtime memory are in both runs)."""
  ram, mapped = child(ckpt_64mb, "numpy"), child(ckpt_64mb, "mmap")
  assert mapped["store_bytes"] == ram["store_bytes"] > 60 * MB
  assert ram["growth"] - mapped["growth"] > 0.75 * mapped["store_bytes"], (ram, mapped)


def test_peak_anonymous_memory_against_the_plan(ckpt_64mb):
  """Peak anonymous RSS above the runtime's own (jax imported, before loading) is within
  the plan's anonymous RAM + 400 MB (the stated tolerance: XLA compiling the decode and
  prompt programs took ~200 MB here, loading ~25 MB), and holds at least the plan's
  expert cache."""
  r = child(ckpt_64mb, "mmap")
  assert r["plan_cache"] <= r["growth"] <= r["plan_anon"] + 400 * MB, r


def test_runs_in_a_memory_cgroup_smaller_than_the_checkpoint(tmp_path):
  """A per-expert checkpoint of 806 MB decodes in a 700 MB memory cgroup: the mapped
  experts are page cache the kernel reclaims, not memory the run owns."""
  from benchmarks import memcg
  why = memcg.available()
  if why:
    pytest.skip(f"memory cgroups unavailable: {why}")
  d = write(config(1024, 512), tmp_path / "ckpt")
  size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
  load_model(d, dtype=jnp.bfloat16, mmap=True)     # the one-time repack, outside the limit
  limit = 700 * MB
  assert size > limit
  r, res = child(d, "mmap", limit=limit)
  assert res.peak_bytes <= limit and r["tokens"] == 8


def test_a_repack_that_does_not_fit_is_refused_before_writing(ckpt_64mb, tmp_path, monkeypatch):
  """Too little free disk for the stacked file: one error naming the bytes and
  MOEJAX_CACHE_DIR, raised before anything is read or written."""
  import shutil
  from collections import namedtuple
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path / "cache"))
  usage = namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
  cfg = config(256, 160)
  kinds = {"gate_up": (320, 256), "down": (256, 160)}
  with pytest.raises(repack.RepackError, match=r"0\.06 GB .* 0\.00 GB free.*MOEJAX_CACHE_DIR"):
    repack.check_space(ckpt_64mb, cfg.moe_layers, 64, kinds, jnp.bfloat16, per_expert=True)
  with pytest.raises(repack.RepackError, match="MOEJAX_CACHE_DIR"):
    loader.check_checkpoint(ckpt_64mb, cfg, jnp.bfloat16)    # what generate runs first
  with pytest.raises(repack.RepackError, match="MOEJAX_CACHE_DIR"):
    load_model(ckpt_64mb, dtype=jnp.bfloat16, mmap=True)
  assert not os.path.exists(repack.stacked_path(ckpt_64mb, jnp.bfloat16))
  assert not os.path.exists(repack.stacked_path(ckpt_64mb, jnp.bfloat16) + ".part")
  # no repack needed (not per-expert): nothing to check
  repack.check_space(ckpt_64mb, cfg.moe_layers, 64, kinds, jnp.bfloat16, per_expert=False)


def _aligned_fused(tmp_path, nan_at=None) -> str:
  """A fused bf16 checkpoint whose tensors start on 64-byte boundaries (mapped as it is);
  nan_at=(layer, expert): a NaN in that expert's gate_up."""
  from moejax.io.safetensors_io import SafetensorsFile, write_streamed
  cfg = config(256, 160)
  d = tmp_path / ("nan" if nan_at else "ok")
  params, exps = init_random(cfg, seed=0, dtype=jnp.bfloat16)
  save_hf(cfg, params, exps, str(d), dtype=jnp.bfloat16, layout="fused")
  f = SafetensorsFile(str(d / "model.safetensors"))
  tensors = {n: np.array(f.get(n)) for n in f.keys()}
  if nan_at:
    tensors[f"model.layers.{nan_at[0]}.mlp.experts.gate_up_proj"][nan_at[1], 3, 5] = np.nan
  del f
  write_streamed(str(d / "model.safetensors"), [(n, a.dtype, a.shape) for n, a in
                                                tensors.items()], lambda n: [tensors[n]],
                 {"format": "pt"}, align=64)
  return str(d)


def test_an_aligned_fused_checkpoint_is_mapped_as_it_is_and_checked_once(tmp_path):
  d = _aligned_fused(tmp_path)
  _, _, store = load_model(d, dtype=jnp.bfloat16, mmap=True)
  gu = store.stacked(0)["gate_up"]
  assert os.path.realpath(gu.filename) == os.path.realpath(os.path.join(d, "model.safetensors"))
  assert os.path.exists(repack.checked_stamp(d, jnp.bfloat16))     # not read whole again
  assert not os.path.exists(repack.stacked_path(d, jnp.bfloat16))   # no repack
  bad = _aligned_fused(tmp_path, nan_at=(2, 7))
  with pytest.raises(Exception, match=r"layers\.2\.mlp\.experts\.gate_up_proj' \(expert 7\) "
                                      r"contains NaN"):
    load_model(bad, dtype=jnp.bfloat16, mmap=True)
  assert not os.path.exists(repack.checked_stamp(bad, jnp.bfloat16))


@pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ compiler: no kernels")
def test_a_mapped_store_asks_for_its_blocks_before_copying(tmp_path):
  """The decode step of an engine over a mapped store asks the OS for the blocks it will
  copy (cpu_rows.will_need, one call per tensor kind); over a store in RAM it does not."""
  cfg = config(128, 64)
  path = write(cfg, tmp_path)
  calls = {}
  for kind in ("mmap", "numpy"):
    _, params, store = load_model(path, dtype=jnp.bfloat16, mmap=kind == "mmap", progress=False)
    eng = OffloadEngine(cfg, params, store, EngineConfig.make("baseline", dtype="bfloat16"))
    hlo = decode.step_fn(eng.program).lower(eng.params, eng.sources, eng.new_carry(),
                                            np.int32(0), np.int32(0)).as_text()
    calls[kind] = hlo.count("custom_call @moejax_will_need")
  assert calls == {"mmap": 2, "numpy": 0}, calls   # gate_up and down, in the scan's body
