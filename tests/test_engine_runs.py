"""Layer runs (`runs`: the layers that need no host work in one call) give the same
outputs, records and resident sets as one call per layer step, for every preset, with
staging slots, the host policy, a link, two layer kinds and a dense first layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.offload import link as link_lib
from moejax.offload import policy as P
from moejax.offload import runs as runs_lib
from moejax.offload.engine import OffloadEngine
from moejax.offload.stats import COUNT_KEYS
from tests.test_engine_fused import PROMPT, QUALITY, STREAM, _layers, _model  # shared cases


def _run(cfg, params, store, policy, runs, min_layers=3, **kw):
  with OffloadEngine(cfg, params, store, policy, max_len=32, fuse_layers=not runs,
                     run_layers=runs, run_min_layers=min_layers, **kw) as eng:
    eng.warmup()
    eng.trace = True
    out = [eng.prefill(PROMPT)] + [eng.decode_step(t) for t in STREAM]
  return eng, np.stack(out)


CASES = [   # (family, model overrides, policy, engine kwargs)
    ("qwen3_moe", {}, "baseline", dict(cache_fraction=0.25)),
    ("qwen3_moe", {}, "baseline", dict(cache_fraction=1.0)),    # all resident: one call
    ("qwen3_moe", {}, QUALITY, dict(cache_fraction=0.25, link="20MB/s")),
    ("qwen3_moe", {}, "speed", dict(cache_fraction=0.125)),     # 1 slot < top-k: staging, trim
    ("qwen3_moe", {}, "substitute_all", dict(cache_fraction=0.25)),
    ("qwen3_moe", {}, "host", dict(cache_fraction=0.5)),
    ("qwen3_next", {}, QUALITY, dict(cache_fraction=0.25)),     # DeltaNet + full attention
    ("qwen3_next", {}, "speed", dict(cache_fraction=0.125)),
    ("glm4_moe", dict(num_hidden_layers=3), QUALITY, dict(cache_fraction=0.25)),  # dense first
    ("glm4_moe", dict(num_hidden_layers=3), "baseline", dict(cache_fraction=1.0)),
]


@pytest.mark.parametrize("family,over,policy,kw", CASES,
                         ids=[f"{c[0]}-{c[2] if isinstance(c[2], str) else 'quality'}-{i}"
                              for i, c in enumerate(CASES)])
def test_runs_equal_per_layer_calls(family, over, policy, kw, tmp_path_factory):
  cfg, params, store = _model(family, over, tmp_path_factory)
  if "link" in kw:
    kw = dict(kw, link=link_lib.parse_link(kw["link"], expert_bytes=store.expert_nbytes()))
  sep, out_sep = _run(cfg, params, store, policy, False, **kw)
  # min_layers=0: a run at every point of a token (also right after a stop); the
  # default: runs only where they are expected to cover 3 MoE layers or end the token
  for min_layers in (0, 3):
    run, out_run = _run(cfg, params, store, policy, True, min_layers, **kw)
    np.testing.assert_array_equal(out_run, out_sep)
    for a, b in zip(run.records, sep.records):
      assert {k: a[k] for k in COUNT_KEYS} == {k: b[k] for k in COUNT_KEYS}
      assert _layers(a) == _layers(b)
    assert run.resident_sets() == sep.resident_sets()
    # calls per token: one run per stretch of layers between host work
    calls = [sum(ev == "run" for ev, _, _ in tr) for tr in run.traces]
    host_layers = [sum(1 for r in rec.layers.values()
                       if r.fetched or r.admissions or r.admitted or P.HOST in r.actions)
                   for rec in run.records]
    for c, h in zip(calls, host_layers):
      assert c <= 1 + 2 * h
      if min_layers == 0:
        assert c >= 1
    if kw.get("cache_fraction") == 1.0:   # all resident: the straight run, one per token
      assert calls == [1] * len(STREAM)
      straight = runs_lib.run_fn(cfg, run.dtype, run.policy.decision, run.policy.cache, None,
                                 straight=True)
      assert straight._cache_size() == 1
  if policy is QUALITY and family == "qwen3_moe":   # admissions inserted by the host
    assert sum(r["admitted"] for r in run.records) > 0


def test_run_compiles_once(tmp_path_factory):
  cfg, params, store = _model("qwen3_moe", {}, tmp_path_factory)
  policy = P.make_policy("quality", admission_beta=0.07)     # a policy no other test builds
  with OffloadEngine(cfg, params, store, policy, cache_fraction=0.25, max_len=32,
                     run_min_layers=0) as eng:
    run = runs_lib.run_fn(cfg, eng.dtype, eng.policy.decision, eng.policy.cache, None)
    assert run._cache_size() == 0
    eng.warmup()
    assert run._cache_size() == 1
    eng.prefill(PROMPT)
    for t in STREAM:
      eng.decode_step(t)
    assert run._cache_size() == 1
    assert sum(r["admitted"] for r in eng.records) > 0      # stops before a layer ran


def test_unpack_info_hand_checked():
  # 2 MoE layers (1 and 3), K=1, E=2 -> packed decision of 5K+E = 7; 2 slots
  layers, k, e, s = (1, 3), 1, 2, 2
  info = np.concatenate([[runs_lib.AFTER_DECISION, 3], [1, 1], [1, 0],
                         np.arange(7), np.arange(7) + 10, [5, -1], [-1, -1]]).astype(np.float32)
  got = runs_lib.unpack_info(info, layers, k, e, s)
  assert (got.kind, got.layer) == (runs_lib.AFTER_DECISION, 3)
  assert got.decided == [1, 3] and got.moe_ran == [1]
  np.testing.assert_array_equal(got.packed[3], np.arange(7) + 10)
  np.testing.assert_array_equal(got.evicted[1], [5, -1])
  assert 3 not in got.evicted


@pytest.mark.parametrize("family,over,frac", [("qwen3_moe", {}, 1.0),
                                              ("glm4_moe", dict(num_hidden_layers=3), 1.0),
                                              ("qwen3_moe", {}, 0.25)])   # not deferrable
def test_lazy_steps_equal_plain_steps(family, over, frac, tmp_path_factory):
  """decode_step(tok, lazy=True) with the token on the device: the same logits, greedy
  tokens, records and resident sets as plain steps; at most 32 records unread."""
  cfg, params, store = _model(family, over, tmp_path_factory)
  n = 40
  outs = {}
  for lazy in (False, True):
    with OffloadEngine(cfg, params, store, "baseline", cache_fraction=frac, max_len=64) as eng:
      eng.warmup()
      logits = eng.prefill(PROMPT)
      got, unread = [], []
      for _ in range(n):
        if lazy:
          logits = eng.decode_step(jnp.argmax(logits).astype(jnp.int32), lazy=True)
          assert isinstance(logits, jax.Array)
        else:
          logits = eng.decode_step(int(np.argmax(logits)))
        got.append(logits)
        unread.append(eng.deferred_steps)
      outs[lazy] = (np.stack([np.asarray(g) for g in got]), list(eng.records),
                    eng.resident_sets(), unread, eng.deferred_steps)
      if lazy:        # a plain step after lazy ones: their records first, in order
        eng.decode_step(jnp.argmax(logits).astype(jnp.int32), lazy=True)
        assert isinstance(eng.decode_step(int(np.argmax(logits))), np.ndarray)
        assert eng.deferred_steps == (0, 0) and len(eng.records) == n + 2
  np.testing.assert_array_equal(outs[True][0], outs[False][0])
  assert len(outs[True][1]) == len(outs[False][1]) == n
  for a, b in zip(outs[True][1], outs[False][1]):
    assert {k: a[k] for k in COUNT_KEYS} == {k: b[k] for k in COUNT_KEYS}
    assert _layers(a) == _layers(b)
    assert a.wall_s > 0
  assert outs[True][2] == outs[False][2]
  assert outs[True][4] == (0, 0)                  # reading `records` built them all
  on_device = [u for u, _ in outs[True][3]]
  if frac == 1.0:     # at most 32 on the device; the older ones read back, not yet built
    assert max(on_device) == 32 and on_device[:3] == [1, 2, 3]
    assert outs[True][3][-1] == (32, n - 32)
  else:
    assert outs[True][3] == [(0, 0)] * n


def test_state_table_stacks_and_unstacks_the_metadata():
  """`StateTable`: the straight run's stacked metadata and the per-layer states stay one
  thing: stacked rows are the layers in order, a stacked successor shows in every layer,
  a per-layer write after it keeps the other layers' successor values and restacks."""
  from moejax.offload import resident as resident_lib
  spec = {"w": ((2,), jnp.float32)}
  states = {l: resident_lib.init_state(4, 2, spec) for l in (1, 3)}   # MoE layers 1 and 3
  states[3] = dataclasses.replace(states[3], freq=jnp.asarray([1.0, 2.0, 3.0, 4.0]))
  table = runs_lib.StateTable(states)
  assert list(table) == [1, 3] and len(table) == 2
  st = table.stacked()
  assert set(st) == set(runs_lib.META) and st["freq"].shape == (2, 4)
  np.testing.assert_array_equal(st["freq"], [[0, 0, 0, 0], [1, 2, 3, 4]])
  # the run's successor: layer 1's step becomes 5, layer 3's freq doubles
  table.set_stacked(dict(st, step=st["step"].at[0].set(5), freq=st["freq"] * 2))
  assert int(table[1].step) == 5 and int(table[3].step) == 0
  np.testing.assert_array_equal(table[3].freq, [2, 4, 6, 8])
  assert table[1].buffers is states[1].buffers       # slot buffers are never stacked
  table[1] = dataclasses.replace(table[1], step=jnp.asarray(7, table[1].step.dtype))
  np.testing.assert_array_equal(table[3].freq, [2, 4, 6, 8])   # kept
  st = table.stacked()
  np.testing.assert_array_equal(st["step"], [7, 0])
  np.testing.assert_array_equal(st["freq"][1], [2, 4, 6, 8])
  with pytest.raises(TypeError):
    del table[1]
