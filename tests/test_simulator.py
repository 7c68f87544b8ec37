"""The replay simulator: hand-checked steps, and decision-by-decision agreement with the
OffloadEngine on the demo model (DESIGN.md, issue 14 part 4)."""

import os

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.research import simulator as sim
from moejax.io import traces
from moejax.model.config import ModelConfig
from moejax.cache import policy as P

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")


def tiny_cfg(num_experts=4, top_k=2, layers=1):
  return ModelConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=layers,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=num_experts,
                     top_k=top_k, moe_intermediate_size=4, intermediate_size=8,
                     sparse_layers=(True,) * layers, qk_norm="head",
                     norm_topk_prob=True).validate()


def logits_for(rows, num_experts=4):
  """Router logits whose top-2 are rows[t] = (first, second) with gates ~ (0.88, 0.12)."""
  out = np.full((len(rows), 1, num_experts), -10.0, np.float32)
  for t, (a, b) in enumerate(rows):
    out[t, 0, a], out[t, 0, b] = 2.0, 0.0
  return out


def test_fetch_all_lru_by_hand():
  # E=4, K=2, 50% resident: S=2 slots, empty cache.  Tokens route (0,1) (0,1) (2,3) (0,2).
  cfg = tiny_cfg()
  lg = logits_for([(0, 1), (0, 1), (2, 3), (0, 2)])
  r, = sim.simulate(cfg, lg, ["baseline"], cache_fraction=0.5, detail=True)
  f = sim.STAT_FIELDS
  per_tok = r.detail["stats"][:, 0]
  np.testing.assert_array_equal(per_tok[:, f.index("hits")], [0, 2, 0, 1])
  np.testing.assert_array_equal(per_tok[:, f.index("fetches")], [2, 0, 2, 1])
  # token 2 evicts 0 and 1; token 3 hits 2 (in use: protected) and 0 evicts 3
  np.testing.assert_array_equal(per_tok[:, f.index("evictions")], [0, 0, 2, 1])
  assert sorted(r.detail["resident"][-1, 0].tolist()) == [0, 2]
  assert r.total("expert_calls") == 8 and r.total("misses") == 5
  np.testing.assert_array_equal(r.steps_TxLxC[:, 0, sim.STEP_FIELDS.index("fetches")],
                                [2, 0, 2, 1])


def test_substitution_and_admission_timing_by_hand():
  # substitute_all + admission(0.1): expert 1 (share 0.12) missed at token 0 is substituted,
  # requested, and inserted before the layer at token 1: a hit there.
  cfg = tiny_cfg()
  pol = P.make_policy("substitute_all", admission_beta=0.1)
  lg = logits_for([(0, 1), (0, 1)])
  r, = sim.simulate(cfg, lg, [pol], cache_fraction=0.5, initial_LxS=np.asarray([[2, 0]]),
                    detail=True)
  f = sim.STAT_FIELDS
  st = r.detail["stats"][:, 0]
  np.testing.assert_array_equal(st[:, f.index("substituted")], [1, 0])
  np.testing.assert_array_equal(st[:, f.index("admissions")], [1, 0])
  np.testing.assert_array_equal(st[:, f.index("admitted")], [0, 1])
  np.testing.assert_array_equal(st[:, f.index("hits")], [1, 2])
  gates = np.exp([2.0, 0.0]) / np.exp([2.0, 0.0]).sum()
  np.testing.assert_allclose(st[0, f.index("substituted_mass")], gates[1], rtol=1e-6)
  # expert 1 took slot 0 from expert 2: both residents were used at step 0 (0 hit, 2 as the
  # substitute), and lru ties go to the lowest slot; inserted at the end of token 0 (the
  # resident set after it), counted as admitted at token 1
  assert r.detail["resident"][0, 0].tolist() == [1, 0]
  assert sorted(r.detail["resident"][-1, 0].tolist()) == [0, 1]


def test_variants_in_one_group_equal_separate_runs():
  cfg = tiny_cfg(num_experts=8, top_k=2, layers=2)
  lg = np.random.default_rng(0).standard_normal((40, 2, 8)).astype(np.float32)
  pols = [P.make_policy("quality", tau=t, admission_beta=b) for t, b in [(0.15, 0.5),
                                                                           (0.3, 0.2)]]
  assert sim.static_key(pols[0]) == sim.static_key(pols[1])
  both = sim.simulate(cfg, lg, pols, prefill_tokens=3)
  swapped = sim.simulate(cfg, lg, pols[::-1], prefill_tokens=3)      # same shapes: one compile
  for r, s in zip(both, swapped[::-1]):
    assert r.policy == s.policy
    np.testing.assert_array_equal(r.totals_LxF, s.totals_LxF)
  assert both[0].total("fetches") != both[1].total("fetches")


_SLICED = """
import sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from test_simulator import sliced_case
from moejax.research import simulator as sim
assert len(sim._layer_slices(3)) == 2, sim._layer_slices(3)
np.savez(sys.argv[2], **sliced_case())
"""


def sliced_case():
  """Three layers, two static groups, a prompt, every decision kept: {name: array}."""
  cfg = tiny_cfg(num_experts=8, top_k=2, layers=3)
  lg = np.random.default_rng(1).standard_normal((30, 3, 8)).astype(np.float32)
  pols = [P.make_policy("quality", tau=0.3), P.make_policy("quality", tau=0.1), "baseline"]
  out = {}
  for i, r in enumerate(sim.simulate(cfg, lg, pols, prefill_tokens=2, detail=True, chunk=7)):
    out[f"{i}/totals"], out[f"{i}/steps"] = r.totals_LxF, r.steps_TxLxC
    out.update({f"{i}/{k}": v for k, v in r.detail.items()})
  return out


def test_layers_split_over_two_cpu_devices_replay_the_same(tmp_path):
  # a process with two CPU devices runs layers [0, 2) and [2, 3) concurrently; every
  # count and decision equals this process's replay (one device: one slice)
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  out = tmp_path / "sliced.npz"
  subprocess.run([sys.executable, "-c", _SLICED, os.path.dirname(os.path.abspath(__file__)),
                  str(out)], env=env, check=True, cwd=os.path.dirname(os.path.dirname(DEMO)))
  sliced = dict(np.load(out))
  here = sliced_case()
  assert sorted(sliced) == sorted(here)
  chex.assert_trees_all_equal(sliced, here)
  assert here["0/totals"].sum() != here["2/totals"].sum()


# ------------------------------------------------------------------ engine agreement
# every preset and miss rule (baseline is fetch_all + lru), and least-stale eviction
POLICIES = ["quality", "speed", "baseline", "threshold", "first_choice", "substitute_all", "host",
            P.make_policy("quality", eviction="least_stale"), "fetch_low",
            P.make_policy("threshold_low", tau=0.3, tau_low=0.1, low_bits=4, admission_beta=0.3),
            P.make_policy("cost", lam=5.0)]


@pytest.fixture(scope="module")
def demo():
  if not os.path.exists(os.path.join(DEMO, "config.json")):
    pytest.skip("no demo model at ckpts/demo")
  from moejax.io.loader import load_model
  from moejax.io.store import ExpertStore
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  # zero expert outputs: the residual stream no longer depends on which experts ran,
  # so every policy's engine sees the router logits of the teacher-forced model
  zeroed = ExpertStore.from_stacked(
      [None if l not in store.layers else
       {k: (np.zeros_like(v) if k == "down" else np.asarray(v))
        for k, v in store.stacked(l).items()} for l in range(cfg.num_layers)])
  rng = np.random.default_rng(0)
  tokens = [int(t) for t in rng.integers(1, cfg.vocab_size, 8 + 20)]
  return cfg, params, zeroed, tokens


def engine_records(cfg, params, store, policy, tokens, prompt):
  from moejax.offload.engine import EngineConfig, OffloadEngine
  with OffloadEngine(cfg, params, store, EngineConfig.make(policy, cache_fraction=0.25,
                                                           max_len=len(tokens) + 8)) as eng:
    eng.prefill(tokens[:prompt])
    for t in tokens[prompt:]:
      eng.decode_step(t)
    return eng.records, eng.resident_sets()


def test_simulator_equals_engine_decision_by_decision(demo, tmp_path):
  cfg, params, store, tokens = demo
  prompt = 8
  logits, windows = traces.record_router_logits(cfg, params, store, tokens, seq=len(tokens))
  traces.write_trace(str(tmp_path), _hf(DEMO), logits, tokens, dtype="float32", windows=windows)
  tr = traces.load_trace(str(tmp_path), expect=cfg)
  results = sim.simulate(cfg, tr.logits_TxLxR, POLICIES, prefill_tokens=prompt, detail=True)
  f = sim.STAT_FIELDS
  for name, res in zip(POLICIES, results):
    records, final_sets = engine_records(cfg, params, store, name, tokens, prompt)
    d = res.detail
    assert len(records) == res.tokens == len(tokens) - prompt
    for t, rec in enumerate(records):
      for j, l in enumerate(cfg.moe_layers):
        lr, where = rec.layers[l], (name, t, l)
        assert list(lr.ids) == d["ids"][t, j].tolist(), where
        assert list(lr.actions) == d["action"][t, j].tolist(), where
        assert list(lr.substitutes) == d["sub_ids"][t, j].tolist(), where
        assert list(lr.fetched) == [e for e, a in zip(lr.ids, lr.actions)
                                    if a in (P.FETCH, P.FETCH_LOW)], where
        assert list(lr.admissions) == [e for e in d["admit"][t, j].tolist() if e >= 0], where
        prev = d["admit"][t - 1, j].tolist() if t else []
        assert sorted(lr.admitted) == [e for e in prev if e >= 0], where
        assert len(lr.evicted) == d["stats"][t, j, f.index("evictions")], where
      per = d["stats"][t].sum(axis=0)
      # the trace's router logits come from a whole-sequence forward, the engine's from
      # its per-token steps: equal to ~1e-6, so the masses agree to float32 rounding
      np.testing.assert_allclose(per[f.index("substituted_mass")], rec.substituted_mass,
                                 rtol=2e-5, atol=1e-5)
      for k in ("fetches", "fetches_low", "admitted"):     # full and low fetches apart
        assert per[f.index(k)] == rec[k], (name, t, k)
    # both insert the last token's admissions at its end (the state the next token sees)
    for j, l in enumerate(cfg.moe_layers):
      assert set(final_sets[l]) == {int(e) for e in d["resident"][-1, j] if e >= 0}, (name, l)
    assert res.total("misses") > 0 and records[-1].misses > 0     # the cache really missed
  assert all(r.total("fetches_low") > 0 for r in results[-3:])    # low copies were fetched
  # least-stale really evicted otherwise than lru (quality, results[0]) on this trace
  sets = [np.sort(r.detail["resident"], axis=-1) for r in (results[0], results[7])]
  assert (sets[0] != sets[1]).any()


def _hf(model_dir):
  import json
  with open(os.path.join(model_dir, "config.json")) as fh:
    return json.load(fh)


# ------------------------------------------------------------------ time model
from moejax.offload import hardware  # noqa: E402
from moejax.research import timemodel  # noqa: E402


def tp(**kw):
  base = dict(name="t", head_s=0.0, layer_s=0.1, expert_s=0.0, host_expert_s=0.0,
              transfer_s=1.0, latency_s=0.0)
  return timemodel.TimeParams(**dict(base, **kw))


def steps(rows):
  """rows[t][l] = (fetches, host_calls, admissions, device_calls[, fetches_low])."""
  return np.asarray([[tuple(c) + (0,) * (5 - len(c)) for c in r] for r in rows], np.int8)


def test_low_precision_fetches_take_their_share_of_the_link_by_hand():
  # one layer: 1 full + 2 int4 fetches (low_ratio 0.25): latency + (1 + 2 x 0.25) transfers
  p = tp(latency_s=0.05, low_ratio=0.25)
  s = steps([[(1, 0, 0, 3, 2)]])
  np.testing.assert_allclose(timemodel.time_per_token(s, p), [0.1 + 0.05 + 1.5], rtol=1e-6)


def test_time_of_sync_fetches_host_and_experts_by_hand():
  p = tp(head_s=0.5, expert_s=0.01, host_expert_s=0.2, latency_s=0.05, fetch_overhead_s=0.03)
  s = steps([[(2, 0, 0, 8), (0, 1, 0, 7)]])
  # head + 2 layers + (latency + 2 transfers + overhead) + 15 device experts + 1 host expert
  want = 0.5 + 0.2 + (0.05 + 2.0 + 0.03) + 15 * 0.01 + 0.2
  np.testing.assert_allclose(timemodel.time_per_token(s, p), [want], rtol=1e-6)


def test_admission_arrives_late_and_the_layer_waits():
  # token 0 requests one admission at layer 0 (1 s on the link); token 1's layer 0 starts
  # 0.2 s later and waits the remaining 0.8 s
  s = steps([[(0, 0, 1, 8), (0, 0, 0, 8)], [(0, 0, 0, 8), (0, 0, 0, 8)]])
  np.testing.assert_allclose(timemodel.time_per_token(s, tp()), [0.2, 1.0], rtol=1e-6)


def test_sync_fetch_waits_only_for_the_background_piece_on_the_link():
  # background admission (4 pieces of 0.25 s) from layer 0; layer 1's fetch, 0.1 s later,
  # waits 0.9 mod 0.25 = 0.15 s, then 1 s; the background resumes after it
  s = steps([[(0, 0, 1, 8), (1, 0, 0, 8)], [(0, 0, 0, 8), (0, 0, 0, 8)]])
  np.testing.assert_allclose(timemodel.time_per_token(s, tp()), [0.1 + 0.1 + 0.15 + 1.0,
                                                                   0.1 + 0.65 + 0.1], rtol=1e-5)


def test_roofline_of_qwen3_30b_on_rtx3090():
  p = timemodel.roofline(hardware.hardware("rtx3090"), hardware.model_shape("qwen3-30b-a3b"))
  np.testing.assert_allclose(p.transfer_s, 9_437_184 / 25e9)
  np.testing.assert_allclose(p.expert_s, 9_437_184 / 936e9)
  np.testing.assert_allclose(p.layer_s, (37_748_736 + 524_288 + 8_704) / 936e9)
  np.testing.assert_allclose(p.head_s, 151936 * 2048 * 2 / 936e9)


def test_unknown_profile_lists_the_known_ones():
  with pytest.raises(hardware.ProfileError, match="known: rtx3090, rtx4090, a100, h100, h200, "
                                                  "gh200, rtx3090_nvme, ddr5_nvme, ddr4_sata, "
                                                  "vm_disk, this_machine"):
    hardware.hardware("rtx5090")
