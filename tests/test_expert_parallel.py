"""Expert parallelism (moejax.offload.expert_parallel) on the demo model: exactness against
the resident model and against one device holding the union, the hit rate as the union
grows, one host with 8 CPU devices and two processes through jax.distributed.

The multi-device checks run in child processes (tests/expert_parallel_child.py): a JAX
process fixes its device count when it starts."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from moejax.cache import resident
from moejax.offload import expert_parallel
from moejax.offload.link import Link, LinkClock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "expert_parallel_child.py")
DEMO = os.path.join(ROOT, "ckpts", "demo")
needs_demo = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "config.json")),
                                reason="no demo model at ckpts/demo")


def _child(args, env, timeout=600):
  return subprocess.Popen([sys.executable, CHILD, *args], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, what, timeout=600):
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail(f"{what} did not finish within {timeout} s")
  assert proc.returncode == 0, f"{what} failed:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
  out = tmp_path_factory.mktemp("ep") / "local.json"
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                    + " --xla_force_host_platform_device_count=8").strip())
  _finish(_child(["local", str(out)], env), "the 8-device child")
  return json.load(open(out))


@needs_demo
def test_fetch_all_equals_the_resident_model(local):
  assert local["devices"] == 8
  for n in (1, 2, 4, 8):
    assert local[f"fetch_all_{n}_argmax_equal"]
    assert local[f"fetch_all_{n}_maxdiff"] < 1e-3, local


@needs_demo
def test_the_union_is_one_cache(local):
  # 2 devices x 25% make exactly the decisions of 1 device x 50%
  assert local["union_same_decisions"] and local["union_same_resident"]
  assert local["union_maxdiff"] < 1e-3
  # a pinned_host store (the GPU layout; copies move rows to each device's memory)
  assert local["pinned_same_decisions"] and local["pinned_maxdiff"] < 1e-5
  # the devices' hits add up to the union's
  assert len(local["union_device_hit_rates"]) == 2
  np.testing.assert_allclose(sum(local["union_device_hit_rates"]), local["union_hit_rate"],
                             rtol=1e-9)


@needs_demo
def test_hit_rate_rises_with_the_union(local):
  # 12.5% per device: 8, 16, 32, 64 slots in the union
  h = {int(k): v for k, v in local["late_hit_rate"].items()}
  assert h[1] < h[2] < h[4] < h[8] == 1.0, h
  for n, rates in local["device_hit_rates"].items():
    if int(n) > 1:
      assert len(rates) == int(n)
      np.testing.assert_allclose(sum(rates), local["hit_rate"][n], rtol=1e-9)
  # 4 devices x 25% hold every expert of the layer: every call hits
  assert local["all_in_union_hit_rate"] == 1.0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@needs_demo
def test_two_processes_through_jax_distributed(tmp_path):
  from moejax.io.loader import load_model
  from moejax.offload.engine import EngineConfig, OffloadEngine
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import expert_parallel_child as child   # pylint: disable=import-outside-toplevel
  port = _free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  outs = [tmp_path / f"p{i}.json" for i in range(2)]
  procs = [_child(["host", str(i), str(port), str(outs[i])], env) for i in range(2)]
  for i, p in enumerate(procs):
    _finish(p, f"process {i}")
  got = [json.load(open(o)) for o in outs]
  assert [g["process"] for g in got] == [0, 1]
  assert all(g["devices"] == 4 and g["local_devices"] == 2 for g in got)
  # one device holding the union of the 4 devices' slots (4 x 12.5%)
  cfg, params, store = load_model(DEMO)
  config = EngineConfig.make("quality", cache_fraction=0.5, max_len=64)
  with OffloadEngine(cfg, params, store, config) as eng:
    ref = np.stack([eng.prefill(child.PROMPT)] + [eng.decode_step(t) for t in child.STREAM])
    ref_dec = child.decisions(eng.records)
  for g in got:
    assert g["decisions"] == ref_dec
    np.testing.assert_allclose(np.asarray(g["logits"]), ref, atol=1e-3)


def test_budget_is_per_device():
  b = resident.make_budget(64, 8, 1000, 4, fraction=0.25, devices=2)
  assert (b.slots, b.staging, b.slots_per_device, b.devices) == (32, 0, 16, 2)
  assert b.device_bytes == 17 * 1000 * 4           # one device's slots + scratch row
  eight = resident.make_budget(64, 8, 1000, 4, fraction=0.25, devices=8)
  assert (eight.slots, eight.slots_per_device) == (64, 8)   # no slot that would stay empty
  with pytest.raises(resident.BudgetError, match="--expert_devices=2 x 2 slots"):
    resident.make_budget(64, 8, 1000, 4, fraction=2 / 64, devices=2)


def test_too_few_devices_names_the_flag():
  with pytest.raises(expert_parallel.ExpertParallelError, match="--expert_devices=64"):
    expert_parallel.make_plan(64, 4)


def test_one_link_per_device():
  link = Link("emulated 1 kB/s", 1e3, 0.0)       # an expert (1000 bytes) takes 1 s
  one = LinkClock(link, 1000, (0,))
  two = LinkClock(link, 1000, (0,), links=2)
  # two fetches on one link take 2 s; one on each of two links, 1 s; both on one, 2 s
  assert one.token(0.0, [2], [0], [0])[1]["wait_s"] == pytest.approx(2.0)
  assert two.token(0.0, [np.array([1, 1])], [0], [0])[1]["wait_s"] == pytest.approx(1.0)
  assert two.token(0.0, [np.array([2, 0])], [0], [0])[1]["wait_s"] == pytest.approx(2.0)


def test_simulator_union_and_time_model():
  from moejax.model.config import ModelConfig
  from moejax.offload import hardware
  from moejax.research import simulator, timemodel
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, num_experts=16, top_k=2,
                    moe_intermediate_size=8, intermediate_size=32, sparse_layers=(True,) * 2,
                    max_position_embeddings=128).validate()
  logits = np.random.default_rng(0).normal(size=(40, 2, 16)).astype(np.float32)
  two = simulator.simulate(cfg, logits, ["quality"], cache_fraction=0.25, devices=2)[0]
  one = simulator.simulate(cfg, logits, ["quality"], cache_fraction=0.5)[0]
  assert two.slots == one.slots == 8
  np.testing.assert_array_equal(two.steps_TxLxC, one.steps_TxLxC)
  hw = hardware.hardware("rtx3090x4")
  assert (hw.devices, hw.link_Bps) == (4, hardware.hardware("rtx3090").link_Bps)
  with pytest.raises(hardware.ProfileError, match="NAMExN"):
    hardware.hardware("rtx3090x")
  # 4 fetches of one layer: 4 transfers on one link, 1 on each of 4 links (+ all-reduce)
  tp1 = timemodel.TimeParams("t", 0.0, 1.0, 0.0, 0.0, 10.0, 0.0)
  tp4 = timemodel.TimeParams("t", 0.0, 1.0, 0.0, 0.0, 10.0, 0.0, devices=4, collective_s=0.5)
  steps = np.zeros((1, 1, len(simulator.STEP_FIELDS)), np.int32)
  steps[0, 0, 0] = 4
  assert timemodel.time_per_token(steps, tp1)[0] == pytest.approx(41.0)
  assert timemodel.time_per_token(steps, tp4)[0] == pytest.approx(11.5)
