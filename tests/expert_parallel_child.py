"""Expert-parallel checks that need several JAX devices, run as a child process by
tests/test_expert_parallel.py (JAX's device count is fixed when it starts).

  python tests/expert_parallel_child.py local OUT.json            8 CPU devices
  python tests/expert_parallel_child.py host PID PORT OUT.json    one of two processes

Writes what it measured as JSON; the test asserts on it.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")
PROMPT = [17, 250, 31, 999, 12, 4000, 77, 5]
STREAM = [int(t) for t in np.random.default_rng(5).integers(1, 8000, 16)]


def decode(model, policy, frac, devices, stream=STREAM):
  """Teacher-forced logits, records and resident sets of one engine."""
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = model
  with OffloadEngine(cfg, params, store, EngineConfig.make(policy, cache_fraction=frac, max_len=64,
                                                           expert_devices=devices)) as eng:
    logits = [eng.prefill(PROMPT)] + [eng.decode_step(t) for t in stream]
    return np.stack(logits), eng.records, eng.resident_sets(), eng.stats()


def decisions(records):
  return [[list(r.layers[l].actions) + list(r.layers[l].fetched) for l in sorted(r.layers)]
          for r in records]


def local(out_path):
  from moejax.io.loader import load_model
  model = load_model(DEMO)
  cfg, params, store = model
  res = {"devices": len(jax.devices())}
  # the resident model: one device holding every expert (equal to the Sampler, test_engine)
  ref = decode(model, "baseline", 1.0, 1)[0]
  res["hit_rate"], res["device_hit_rates"], res["late_hit_rate"] = {}, {}, {}

  def hits(n, run):
    _, recs, _, st = run
    res["hit_rate"][n] = st["hit_rate"]
    res["device_hit_rates"][n] = st.get("device_hit_rates")
    late = recs[4:]
    res["late_hit_rate"][n] = sum(r.hits for r in late) / sum(r.expert_calls for r in late)

  # fetch every miss at 12.5% per device: the resident model's logits whatever is
  # resident, and a hit rate that rises with the union (8, 16, 32, 64 slots)
  for n in (1, 2, 4, 8):
    run = decode(model, "baseline", 0.125, n)
    res[f"fetch_all_{n}_maxdiff"] = float(np.max(np.abs(run[0] - ref)))
    res[f"fetch_all_{n}_argmax_equal"] = bool(np.all(run[0].argmax(-1) == ref.argmax(-1)))
    hits(n, run)
  # 4 devices x 25% hold every expert
  res["all_in_union_hit_rate"] = decode(model, "quality", 0.25, 4)[3]["hit_rate"]
  # the union of 2 devices x 25% is one cache of 50%: the same decisions as one device
  one = decode(model, "quality", 0.5, 1)
  two = decode(model, "quality", 0.25, 2)
  res["union_same_decisions"] = decisions(one[1]) == decisions(two[1])
  res["union_same_resident"] = one[2] == two[2]
  res["union_maxdiff"] = float(np.max(np.abs(one[0] - two[0])))
  res["union_device_hit_rates"] = two[3]["device_hit_rates"]
  res["union_hit_rate"] = two[3]["hit_rate"]
  # the store in pinned_host memory (the GPU layout): each device moves its rows itself
  from moejax.io.store import make_store
  pinned = decode((cfg, params, make_store(store, "pinned_host")), "quality", 0.25, 2)
  res["pinned_same_decisions"] = decisions(pinned[1]) == decisions(two[1])
  res["pinned_maxdiff"] = float(np.max(np.abs(pinned[0] - two[0])))
  json.dump(res, open(out_path, "w"))


def host(pid, port, out_path):
  """One of two processes, 2 CPU devices each: an engine over all 4."""
  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                             initialization_timeout=120)
  from moejax.io.loader import load_model
  model = load_model(DEMO)
  lg, recs, sets, st = decode(model, "quality", 0.125, 4)
  json.dump({"process": jax.process_index(), "devices": len(jax.devices()),
             "local_devices": len(jax.local_devices()), "logits": lg.tolist(),
             "decisions": decisions(recs), "hit_rate": st["hit_rate"],
             "resident": {str(k): v for k, v in sets.items()}}, open(out_path, "w"))
  jax.distributed.shutdown()


if __name__ == "__main__":
  if sys.argv[1] == "local":
    local(sys.argv[2])
  else:
    host(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
