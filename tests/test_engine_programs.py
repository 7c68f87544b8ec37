"""OffloadEngine programs on the tiny random model of tests/test_engine.py: one trace per
program, lazy steps and the on-device generation loop equal plain steps, every family's
tiny model through speculative prefetch, and low-precision slots."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moejax.cache import policy as P
from moejax.io.loader import load_model
from moejax.offload import decode
from moejax.offload import prompt as prompt_lib
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.model.sampler import SamplingParams
from moejax.serve.metrics import LOWERED
from tests import hf_models
from tests.test_engine import (ADMITTING, MAX_LEN, PROMPT, STREAM, check_budget, counts,
                               layer_records, pending_admissions, run)
from tests.test_engine import model  # noqa: F401  (the module's model fixture)
from tests.test_prefetch import _run as prefetch_run
from tests.test_prefetch import _vectors as vectors


# ------------------------------------------------------------------ compiles
def test_one_trace_per_program_and_identical_statistics_across_engines(model, monkeypatch):
  """The decode step is traced once for every token of two engines with the same program,
  plain or lazy steps (and the prompt once per bucket); two identical runs give identical
  statistics."""
  cfg, params, store, _ = model
  traced = {"step": 0, "prompt": 0}
  step_fn, prompt_fn = decode._decode, prompt_lib.prompt_pass

  def step(*args, **kw):
    traced["step"] += 1
    return step_fn(*args, **kw)

  def prompt(*args, **kw):
    traced["prompt"] += 1
    return prompt_fn(*args, **kw)

  chex.clear_trace_counter()      # (chex counts by source and name: two functions)
  monkeypatch.setattr(decode, "_decode", chex.assert_max_traces(step, n=1))
  monkeypatch.setattr(prompt_lib, "prompt_pass", chex.assert_max_traces(prompt, n=1))
  # substitute_all with admission: a program no other test builds
  policy = P.make_policy("substitute_all", admission_beta=0.3, lfu_decay=0.5)
  stats, records = [], []
  for lazy in (False, True):     # the second engine: lazy steps, the token on the device
    with OffloadEngine(cfg, params, store, EngineConfig.make(policy, cache_fraction=0.25,
                                                             max_len=MAX_LEN)) as eng:
      eng.warmup()
      for prompt in (PROMPT, PROMPT[:3]):             # one prompt bucket
        eng.prefill(prompt)
        for t in STREAM:
          eng.decode_step(jnp.asarray(t, jnp.int32), lazy=True) if lazy else eng.decode_step(t)
          check_budget(eng)
      stats.append(eng.stats())
      records.append(eng.records)
  assert traced == {"step": 1, "prompt": 1}
  times = {k for k in stats[0] if k.endswith("_ms_per_token") or k.startswith("tpot")}
  a, b = ({k: v for k, v in s.items() if k not in times} for s in stats)
  assert a == b and a["tokens"] == 2 * len(STREAM)
  assert [layer_records(r) for r in records[0]] == [layer_records(r) for r in records[1]]
  assert a["fetches_per_token"] == 0 and a["substituted_call_pct"] > 0
  assert a["admitted_per_token"] > 0
  assert 0 < a["substituted_mass_per_token"] <= 2.0 + 1e-6
  for r in records[0]:
    assert r["hits"] + r["misses"] == r["expert_calls"]
    assert r["substituted"] + r["dropped"] + r["host_calls"] == r["misses"]


def test_record_layout_is_known_before_any_step(model):
  """A freshly built engine (and batch) knows its records' layout before any step of its
  program was traced (a policy no other test uses): the fields' shapes, and the width
  that its step packs to."""
  cfg, params, store, _ = model
  policy = P.make_policy("quality", tau=0.55, admission_beta=0.15)
  with OffloadEngine(cfg, params, store, EngineConfig.make(policy, cache_fraction=0.25,
                                                           max_len=MAX_LEN)) as eng:
    like = eng.record_layout.like
    n_l, k = len(eng.moe_layers), cfg.top_k
    slots = eng.budget.slots + eng.budget.staging     # the admitted's, the fetches', a trim's
    assert like.ids.shape == (n_l, k) and like.pf_stats.shape == (n_l, 4)
    assert like.evicted.shape == (n_l, 2 * k + slots)
    packed = jax.eval_shape(decode.step_fn(eng.program), eng.params, eng.sources,
                            eng.new_carry(), np.int32(0), np.int32(0))[2]
    assert packed.shape == (n_l, eng.record_layout.width)
    eng.prefill(PROMPT)
    eng.decode_step(STREAM[0])
    assert eng.records[-1]["expert_calls"] == n_l * k
    batch = eng.batched(3)
    assert batch.record_layout.like.ids.shape == (n_l, 3 * k)
    with pytest.raises(ValueError, match="another program"):
      batch.record_layout.unpack(np.zeros((n_l, eng.record_layout.width), np.float32))


def test_a_warmed_prompt_builds_no_program(model):
  """warmup(prompt_lengths) compiles the prompt pass of each length's bucket: a prefill in
  that bucket then builds no program (its record times the prompt, not a compile), and
  its logits are those of an engine that compiled it on the way."""
  cfg, params, store, _ = model
  built, listening = [], [False]
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, s, **_: built.append(event) if listening[0] and event == LOWERED else None)
  config = EngineConfig.make("quality", cache_fraction=0.25, max_len=MAX_LEN)
  with OffloadEngine(cfg, params, store, config) as cold:
    want = cold.prefill(PROMPT)
  with OffloadEngine(cfg, params, store, config) as eng:
    eng.warmup(prompt_lengths=[len(PROMPT)])
    listening[0] = True
    got = eng.prefill(PROMPT)
    eng.prefill(PROMPT[:-1])                     # the same bucket
    listening[0] = False
  assert built == []
  np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ lazy steps, loop
def test_lazy_steps_equal_plain_steps(model):
  """decode_step(tok, lazy=True) with the token on the device: the same logits, greedy
  tokens, records and resident sets as plain steps (past the 64 steps after which lazy
  records are read back); a plain step after lazy ones keeps the records in order."""
  cfg, params, store, _ = model
  n = 80
  outs = {}
  for lazy in (False, True):
    with OffloadEngine(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                             max_len=MAX_LEN)) as eng:
      logits = eng.prefill(PROMPT)
      got = []
      for _ in range(n):
        if lazy:
          logits = eng.decode_step(jnp.argmax(logits).astype(jnp.int32), lazy=True)
          assert isinstance(logits, jax.Array)
        else:
          logits = eng.decode_step(int(np.argmax(logits)))
        got.append(np.asarray(logits))
      outs[lazy] = (np.stack(got), list(eng.records), eng.resident_sets())
      if lazy:
        eng.decode_step(jnp.argmax(logits).astype(jnp.int32), lazy=True)
        assert isinstance(eng.decode_step(int(np.argmax(logits))), np.ndarray)
        assert len(eng.records) == n + 2 and eng.records[:n] == outs[True][1]
  np.testing.assert_array_equal(outs[True][0], outs[False][0])
  assert len(outs[True][1]) == len(outs[False][1]) == n
  for a, b in zip(outs[True][1], outs[False][1]):
    assert counts(a) == counts(b) and layer_records(a) == layer_records(b)
    assert a.wall_s > 0
  assert outs[True][2] == outs[False][2]
  assert sum(r.admitted for r in outs[True][1]) > 0


def _generate(model, sp, loop):
  cfg, params, store, _ = model
  with OffloadEngine(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                           max_len=MAX_LEN)) as eng:
    seen = []
    toks = eng.generate(PROMPT, sp, seed=3, on_token=None if loop else seen.append)
    assert loop or seen == toks
    return toks, eng.records, eng.resident_sets()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_on_device_loop_equals_per_token_generation(model, temperature):
  """generate() without on_token (one while_loop on the device) gives the tokens, records
  and final resident sets of per-token generation, also when a stop id ends it early."""
  sp = SamplingParams(temperature=temperature, max_new_tokens=24)
  full = _generate(model, sp, loop=False)
  assert len(full[0]) == 24 and len(full[1]) == 23
  stop = full[0][9]
  sp_stop = dataclasses.replace(sp, stop_ids=(stop,))   # the shape of no stop id ([-1])
  for s in (sp, sp_stop):
    per_token = full if s is sp else _generate(model, s, loop=False)
    loop = _generate(model, s, loop=True)
    assert loop[0] == per_token[0]
    assert [layer_records(r) for r in loop[1]] == [layer_records(r) for r in per_token[1]]
    assert [counts(r) for r in loop[1]] == [counts(r) for r in per_token[1]]
    assert loop[2] == per_token[2]
  assert len(loop[0]) == full[0].index(stop) + 1 and loop[0][-1] == stop
  assert len(loop[1]) == len(loop[0]) - 1
  assert sum(r.admitted for r in full[1]) > 0 and sum(r.substituted for r in full[1]) > 0


# ------------------------------------------------------------------ every family
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss", "glm4_moe"]
FAMILY_PROMPT, FAMILY_STREAM = [3, 17, 5, 60, 22, 9], [4, 8, 15, 16, 23, 42]
_BUILT = {}


def family_model(family, tmp_path_factory):
  """A family's tiny random model (tests/hf_models.py), built once per process: (cfg,
  params, store, transformers' logits of FAMILY_PROMPT + FAMILY_STREAM from the prompt's
  last position)."""
  if family not in _BUILT:
    hf = hf_models.build(family)
    with torch.no_grad():
      ref = hf(torch.tensor([FAMILY_PROMPT + FAMILY_STREAM])).logits[0].float().numpy()
    d = hf_models.save(hf, str(tmp_path_factory.mktemp(family)), "per_expert")
    _BUILT[family] = load_model(d) + (ref[len(FAMILY_PROMPT) - 1:],)
  return _BUILT[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_prefetches_and_speculates(family, tmp_path_factory):
  """Every family's router through prediction and speculative execution: the oracle's
  true predictions run the exact model (transformers' logits); quasi and previous run."""
  cfg, params, store, ref = family_model(family, tmp_path_factory)
  run_ = lambda **kw: prefetch_run(cfg, params, store, FAMILY_PROMPT, FAMILY_STREAM,
                                   streaming=True, **kw)
  _, out, _ = run_(prefetch="oracle", speculative="true_router")
  np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
  eng, out, _ = run_(prefetch="quasi", speculative="predicted_weights", predictors=vectors(cfg))
  chex.assert_tree_all_finite(out)
  s = eng.stats()
  if len(cfg.moe_layers) > 1:
    assert s["prefetches_per_token"] > 0 and 0.0 <= s["recall_at_k"] <= 1.0
  # previous: the family's own router output at the previous token, through its rule
  eng, out, _ = run_(prefetch="previous", speculative="predicted_weights")
  chex.assert_tree_all_finite(out)
  for prev, r in zip(eng.records, eng.records[1:]):
    for l in cfg.moe_layers[1:]:
      assert r.layers[l].predicted == prev.layers[l].true_ids


# ------------------------------------------------------------------ low-precision copies
def test_low_precision_slots_hold_dequantised_rows_and_admission_upgrades_them(model):
  """Every resident slot holds the expert's full rows, or its dequantised int4 rows while
  `ResidentState.low` marks it; an admitted low slot becomes full in place; the records
  count low fetches at their own bytes."""
  from moejax.io import quant
  cfg, params, store, ref = model
  low = quant.build(store, 4, 32) if all(np.shape(v)[-1] % 32 == 0 for v in
                                         store.get(store.moe_layers[0], 0).values()) else None
  bits = 4 if low is not None else 8
  low = low or quant.build(store, 8)
  seen = []

  def check(eng):
    pending = pending_admissions(eng)
    now = {}
    for layer, st in eng.states.items():
      lo, se = np.asarray(st.low), np.asarray(st.slot_expert)
      for s, e in enumerate(se):
        if e < 0 or e in pending[layer]:
          continue
        now[(layer, int(e))] = (s, bool(lo[e]))
        want = (np.asarray(quant.dequantize(low.stacked(layer)["down.q"][e],
                                            low.stacked(layer)["down.s"][e], bits))
                if lo[e] else eng.store.get(layer, int(e))["down"])
        np.testing.assert_allclose(np.asarray(st.buffers["down"][s]), want, rtol=0, atol=1e-6)
    seen.append(now)

  pol = P.make_policy("threshold_low", tau=0.9, tau_low=0.01, low_bits=bits, admission_beta=0.8)
  eng, out = run(model, pol, check=check, low_store=low, cache_fraction=0.75)
  assert not np.allclose(out, ref, atol=1e-4)          # low copies changed the logits
  assert any(lo for now in seen for _, lo in now.values())
  # (pending at the token that admits it, so skipped there: compared with the next two)
  upgraded = [k for i, a in enumerate(seen) for k, (s, lo) in a.items() if lo and any(
      b.get(k) == (s, False) and all(k not in c or c[k][0] == s for c in seen[i + 1:j])
      and all(k[1] not in eng.records[t].layers[k[0]].fetched for t in range(i + 1, j + 1))
      for j, b in enumerate(seen[i + 1:i + 3], i + 1))]     # not re-fetched in full meanwhile
  assert upgraded                                      # full rows copied into the same slot
  st = eng.stats()
  assert st["fetches_low_per_token"] > 0
  np.testing.assert_allclose(st["fetch_bytes_per_token"],
                             st["fetches_per_token"] * store.expert_nbytes()
                             + st["fetches_low_per_token"] * low.expert_nbytes())
