"""OffloadEngine invariants on a tiny random model: exactness against the resident model,
the budget, records, the emulated link and errors (DESIGN.md, issue 4 part 6).  The
programs (traces, lazy steps, the on-device loop, every family, low-precision slots):
tests/test_engine_programs.py."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.offload import calibrate
from moejax.model.model import Transformer
from moejax.offload import link as link_lib
from moejax.cache import policy as P
from moejax.cache import initial as IN
from moejax.cache import resident as R
from moejax.offload import stats as stats_lib
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.io.placement import TransferError, TransferTimeout
from moejax.model.sampler import SamplingParams
from tests import tiny_models

PROMPT = [3, 17, 5, 60, 22]
STREAM = [int(t) for t in np.random.default_rng(3).integers(0, 64, 14)]
MAX_LEN = 96          # one cache length for every engine here: tests share their programs
# quality with a low threshold and admission: substitutes, fetches and admits on this model
ADMITTING = P.make_policy("quality", tau=0.6, admission_beta=0.2)


@pytest.fixture(scope="module")
def model():
  cfg = tiny_models.tiny_config((True, False, True))
  store = tiny_models.random_store(cfg, np.random.default_rng(0), 0.2)
  model = Transformer(cfg)
  seq = jnp.asarray([PROMPT + STREAM], jnp.int32)
  # one jitted init and one jitted teacher-forced forward of the fully resident model
  params = jax.jit(lambda k: model.init(k, seq, store.to_device())["params"])(
      jax.random.PRNGKey(0))
  logits, _, _ = jax.jit(lambda p, e: model.apply({"params": p}, seq, e))(params,
                                                                         store.to_device())
  ref = np.asarray(logits[0, len(PROMPT) - 1:])               # prefill's last, then each decode
  return cfg, params, store, ref


def run(model, policy, check=None, tokens=STREAM, **kw):
  cfg, params, store, _ = model
  kw.setdefault("cache_fraction", 0.25)
  low = kw.pop("low_store", None)
  config = EngineConfig.make(policy, max_len=MAX_LEN, **kw)
  with OffloadEngine(cfg, params, store, config, low_store=low) as eng:
    eng.warmup()                                   # compiles on throwaway state only
    out = [eng.prefill(PROMPT)]
    for tok in tokens:
      out.append(eng.decode_step(tok))
      if check:
        check(eng)
    run.sets = eng.resident_sets()      # the final resident sets (states are freed by close)
  return eng, np.stack(out)


def pending_admissions(eng):
  """{MoE layer: the admissions requested at the last decoded token} (its record)."""
  last = eng.records[-1] if eng.records else None
  return {l: list(last.layers[l].admissions) if last else [] for l in eng.moe_layers}


def check_budget(eng):
  """Within the budget, metadata consistent, every resident expert's slot holds its
  weights -- except the admissions requested at the last token: inserted into the cache
  at the end of that token, their copies are made by their layer at the next token."""
  pending = pending_admissions(eng)
  for layer, st in eng.states.items():
    se, es = np.asarray(st.slot_expert), np.asarray(st.expert_slot)
    # within S between tokens, admissions included (staging slots are drained last)
    assert (se >= 0).sum() <= eng.budget.slots
    assert (es >= 0).sum() == (se >= 0).sum()
    assert set(pending[layer]) <= set(eng.resident_sets()[layer])
    for s, e in enumerate(se):
      if e >= 0:
        assert es[e] == s
        if e not in pending[layer]:
          np.testing.assert_array_equal(np.asarray(st.buffers["down"][s]),
                                        eng.store.get(layer, int(e))["down"])


def layer_records(rec):
  return {l: dataclasses.asdict(r) for l, r in rec.layers.items()}


def counts(rec):
  return {k: rec[k] for k in stats_lib.COUNT_KEYS}


# ------------------------------------------------------------------ exactness, budget
def test_fetch_all_matches_fully_resident_model_and_keeps_budget(model):
  eng, out = run(model, "baseline", check=check_budget)
  np.testing.assert_allclose(out, model[3], atol=1e-6, rtol=0)
  st = eng.stats()
  assert st["fetches_per_token"] > 0 and st["hit_rate"] < 1      # the cache really missed
  assert st["substituted_call_pct"] == 0
  for r in eng.records:
    assert r["hits"] + r["misses"] == r["expert_calls"] == 2 * 2   # K x MoE layers
    assert r["fetches"] == r["misses"]
    for lr in r.layers.values():
      assert set(lr.fetched) == {e for e, a in zip(lr.ids, lr.actions) if a == P.FETCH}
  assert eng.prefill_record["fetches"] > 0
  assert pending_admissions(eng) == {0: [], 2: []}


def test_staging_slots_when_budget_is_below_top_k(model):
  eng, out = run(model, "baseline", cache_fraction=0.125, check=check_budget)  # S=1 < K=2
  assert (eng.budget.slots, eng.budget.staging) == (1, 1)
  np.testing.assert_allclose(out, model[3], atol=1e-6, rtol=0)
  for r in eng.records:
    assert all(lr.actions.count(P.HIT) <= 1 for lr in r.layers.values())


def test_host_policy_computes_misses_exactly_inside_the_program(model):
  eng, out = run(model, "host")
  np.testing.assert_allclose(out, model[3], atol=1e-5, rtol=0)
  st = eng.stats()
  assert st["host_calls_per_token"] > 0 and st["fetches_per_token"] == 0
  assert st["host_ms_per_token"] == 0          # no host-side expert work: it is in the program
  assert any(P.HOST in lr.actions for r in eng.records for lr in r.layers.values())


def test_full_budget_fetches_nothing_after_warm_up(model):
  cfg, params, store, ref = model
  config = EngineConfig.make("baseline", cache_fraction=1.0, initial="empty", max_len=MAX_LEN)
  with OffloadEngine(cfg, params, store, config) as eng:
    out = [eng.prefill(PROMPT)] + [eng.decode_step(t) for t in STREAM]
    np.testing.assert_allclose(np.stack(out), ref, atol=1e-6, rtol=0)
    fetched = eng.prefill_record["fetches"] + sum(r["fetches"] for r in eng.records)
    assert 0 < fetched <= 2 * 8                                 # each expert at most once
    assert sum(r["evictions"] for r in eng.records) == 0
    n = len(eng.records)
    for t in STREAM[:10]:                                       # warm: the same tokens again
      eng.decode_step(t)
    assert sum(r["fetches"] for r in eng.records[n:]) == 0
  # the default initial contents for a full budget: everything resident, said so
  eng2, out2 = run(model, "baseline", cache_fraction=1.0)
  assert "every expert" in eng2.describe()
  assert eng2.prefill_record["fetches"] == 0 and sum(r["fetches"] for r in eng2.records) == 0
  assert all(r["hits"] == r["expert_calls"] for r in eng2.records)
  np.testing.assert_allclose(out2, model[3], atol=1e-6, rtol=0)


def test_substituting_presets_count_consistently_and_are_deterministic(model):
  link = link_lib.parse_link("2GB/s,20us")
  eng, out = run(model, ADMITTING, check=check_budget, link=link)
  sets = run.sets
  eng_b, out_b = run(model, ADMITTING, link=link)
  np.testing.assert_array_equal(out, out_b)
  assert [counts(r) for r in eng.records] == [counts(r) for r in eng_b.records]
  assert [layer_records(r) for r in eng.records] == [layer_records(r) for r in eng_b.records]
  assert sets == run.sets
  s = eng.stats()
  assert s["substituted_call_pct"] > 0 and s["admitted_per_token"] > 0
  for r in eng.records:
    assert r["hits"] + r["misses"] == r["expert_calls"]
    assert r["substituted"] + r["dropped"] + r["fetches"] + r["host_calls"] == r["misses"]


def test_admissions_are_in_the_cache_at_the_end_of_their_token(model):
  """An admission requested at token t (its record's `admissions`) is resident right after
  t (`resident_sets`), and recorded as admitted at token t + 1 at the same layer."""
  cfg, params, store, _ = model
  with OffloadEngine(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                           max_len=MAX_LEN)) as eng:
    eng.prefill(PROMPT)
    requested = []
    for tok in STREAM:
      eng.decode_step(tok)
      pend, sets = pending_admissions(eng), eng.resident_sets()
      assert all(set(pend[l]) <= set(sets[l]) for l in cfg.moe_layers)
      requested.append(pend)
    recs = eng.records
  for t, rec in enumerate(recs):        # nothing pending at the first token after a prompt
    for l in cfg.moe_layers:
      assert sorted(rec.layers[l].admitted) == (sorted(requested[t - 1][l]) if t else [])
  assert sum(len(p[l]) for p in requested for l in p) > 0


def test_profile_initial_contents(model):
  cfg, params, store, _ = model
  counts_ = calibrate.profile_counts(cfg, params, store, PROMPT + STREAM)
  config = EngineConfig.make(ADMITTING, cache_fraction=0.25, max_len=MAX_LEN,
                             initial="profile")
  with OffloadEngine(cfg, params, store, config, counts=counts_) as eng:
    assert eng.initial == "profile"
    for layer, experts in eng.resident_sets().items():
      top = IN.profile_order(counts_[layer])[:eng.budget.slots]
      assert experts == sorted(top)
    eng.prefill(PROMPT)
    for t in STREAM:
      eng.decode_step(t)
    check_budget(eng)
    for r in eng.records:
      assert r["hits"] + r["misses"] == r["expert_calls"]


def test_a_long_run_keeps_a_bounded_number_of_records_and_the_same_statistics(model,
                                                                                monkeypatch):
  # the bug: the engine kept every token's record until someone took them (RSS grew by
  # 4.2 kB a token); now a tally has the statistics, and the newest records are kept
  tokens = [int(t) for t in np.random.default_rng(5).integers(0, 64, 40)]
  ref, _ = run(model, ADMITTING, tokens=tokens)          # 40 < RECORDS_KEPT: every record
  ref_records, ref_stats, ref_skip = ref.records, ref.stats(), ref.stats(skip=5)
  monkeypatch.setattr(stats_lib, "RECORDS_KEPT", 8)
  held = []
  eng, _ = run(model, ADMITTING, tokens=tokens,
               check=lambda e: held.append((len(e._kept.unbuilt), len(e._kept.whole))))
  assert max(u for u, _ in held) < 8 and max(w for _, w in held) <= 8     # never read: bounded
  assert len(ref_records) == 40 and len(eng.records) == 8
  assert [counts(r) for r in eng.records] == [counts(r) for r in ref_records[-8:]]
  assert [layer_records(r) for r in eng.records] == [layer_records(r) for r in ref_records[-8:]]
  same = lambda s: {k: v for k, v in s.items() if "ms" not in k}       # timings differ by run
  assert eng.stats()["tokens"] == 40 and same(eng.stats()) == same(ref_stats)
  assert same(eng.stats(skip=5)) == same(ref_skip)
  assert len(eng.take_records()) == 8 and eng.stats() == {"tokens": 0} and eng.records == []


# ------------------------------------------------------------------ the emulated link
def test_results_do_not_depend_on_link_speed(model):
  keys = ("hits", "fetches", "substituted", "admissions", "admitted", "evictions")
  runs = [run(model, ADMITTING, link=link) for link in
          ("native", link_lib.parse_link("1MB/s,50us"))]
  (fast, out_fast), (slow, out_slow) = runs
  np.testing.assert_array_equal(out_fast, out_slow)
  assert [[r[k] for k in keys] for r in fast.records] == [[r[k] for k in keys]
                                                          for r in slow.records]
  assert [layer_records(r) for r in fast.records] == [layer_records(r) for r in slow.records]
  assert sum(r["admitted"] for r in fast.records) > 0
  assert sum(r["admission_wait_s"] for r in slow.records) >= 0
  assert all(r["wait_s"] == 0 and r["admission_wait_s"] == 0 for r in fast.records)


def test_emulated_link_waits_at_least_the_transfer_time(model):
  cfg, params, store, _ = model
  link = link_lib.parse_link("1MB/s,100us")          # one 6 KiB expert: >= 6.2 ms
  eng, _ = run(model, "baseline", link=link)
  s = eng.stats()
  per = link.transfer_time(store.expert_nbytes()) - link.latency_s
  assert s["fetches_per_token"] > 0
  for r in eng.records:
    # each MoE layer's waited fetches take the link at once: n x per expert + latency
    want = sum(len(lr.fetched) * per + (link.latency_s if lr.fetched else 0.0)
               for lr in r.layers.values())
    assert r["wait_s"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert r["wall_s"] >= r["wait_s"] + r["admission_wait_s"] + r["prefetch_wait_s"]
    assert r["wall_s"] >= per * r["fetches"]
    assert r["compute_s"] >= 0
  assert s["wait_ms_per_token"] > 0
  assert eng.link.describe() in stats_lib.format_stats(s, eng.link.describe())


def test_the_prompts_copies_are_charged_to_an_emulated_link(model):
  """Each MoE layer of the prompt waits for the missing experts the prompt used, all at
  once (n x one expert's transfer + latency), as a decoded token's waited fetches do."""
  cfg, params, store, _ = model
  link = link_lib.parse_link("1MB/s,100us")
  per = link.transfer_time(store.expert_nbytes()) - link.latency_s
  with OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=0.25,
                                                           max_len=MAX_LEN, link=link)) as eng:
    eng.warmup([len(PROMPT)])
    t0 = time.perf_counter()
    eng.prefill(PROMPT)
    wall = time.perf_counter() - t0
    rec = eng.prefill_record
  want = sum(len(lr.fetched) * per + (link.latency_s if lr.fetched else 0.0)
             for lr in rec.layers.values())
  assert rec["fetches"] > 0 and want > 0
  assert rec["wait_s"] == pytest.approx(want, rel=1e-9, abs=1e-12)
  assert wall >= want and rec["wall_s"] >= want


def test_a_hung_copy_surfaces_once_after_the_timeout(model):
  """A link so slow that one token's copies outlast transfer_timeout_s: that step raises
  TransferTimeout after about the timeout; every later call raises TransferError naming
  the earlier failure; close() returns at once."""
  cfg, params, store, _ = model
  timeout = 0.5
  config = EngineConfig.make("baseline", cache_fraction=0.25, max_len=MAX_LEN,
                             link="1KB/s,0us", transfer_timeout_s=timeout)   # 6 s an expert
  with OffloadEngine(cfg, params, store, config) as eng:
    eng.warmup()
    with pytest.raises(TransferTimeout, match="transfer_timeout_s=0.5") as first:
      t0 = time.perf_counter()
      eng.prefill(PROMPT)                           # the prompt's copies take the link too
      for tok in STREAM:
        t0 = time.perf_counter()
        eng.decode_step(tok)                        # a token without a fetch waits nothing
    elapsed = time.perf_counter() - t0
    assert timeout <= elapsed < 2 * timeout
    for call in (lambda: eng.decode_step(STREAM[0]), lambda: eng.prefill(PROMPT),
                 eng.warmup):
      t0 = time.perf_counter()
      with pytest.raises(TransferError, match="earlier failure.*transfer_timeout_s") as later:
        call()
      assert type(later.value) is TransferError and later.value.__cause__ is first.value
      assert time.perf_counter() - t0 < 0.1
    t0 = time.perf_counter()
    eng.close()
    assert time.perf_counter() - t0 < 0.1
  with pytest.raises(TransferError):
    eng.decode_step(STREAM[0])


# ------------------------------------------------------------------ errors
def test_bad_inputs_name_the_flag(model):
  cfg, params, store, _ = model
  with pytest.raises(P.PolicyError, match="--policy"):
    OffloadEngine(cfg, params, store, EngineConfig.make("turbo"))
  with pytest.raises(R.BudgetError, match="--cache_fraction"):
    OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=0.01))
  with pytest.raises(link_lib.LinkSpecError, match="--link"):
    OffloadEngine(cfg, params, store, EngineConfig.make("baseline", link="fast please"))
  with OffloadEngine(cfg, params, store, EngineConfig.make("baseline", max_len=MAX_LEN)) as eng:
    with pytest.raises(ValueError, match="before prefill"):
      eng.decode_step(1)
    with pytest.raises(ValueError, match="max_len"):
      eng.prefill(list(range(MAX_LEN)))
    with pytest.raises(ValueError, match="max_len"):
      eng.generate(PROMPT, SamplingParams(max_new_tokens=MAX_LEN))


class _Unreadable:
  """An expert tensor whose bytes cannot be read (a truncated memory-mapped file)."""
  shape, dtype = (8, 32, 16), np.float32

  def __array__(self, dtype=None, copy=None):
    raise OSError("truncated file")


class BrokenStore:
  """The store with MoE layer 2's `down` tensor unreadable."""

  def __init__(self, inner):
    self.inner = inner

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def stacked(self, layer):
    st = dict(self.inner.stacked(layer))
    if layer == 2:
      st["down"] = _Unreadable()
    return st


def test_an_unreadable_store_is_a_clear_error_naming_layer_and_tensor(model):
  cfg, params, store, _ = model
  with pytest.raises(TransferError, match=r"'down' of MoE layer 2.*OSError: truncated file"):
    OffloadEngine(cfg, params, BrokenStore(store), EngineConfig.make("baseline", max_len=MAX_LEN))


def test_calibration_keeps_no_device_copy_of_the_experts(model):
  import gc
  cfg, params, store, _ = model
  live = lambda: sum(a.nbytes for a in jax.live_arrays())
  calibrate.layer_compute_seconds(cfg, params, store, steps=3)   # compiles
  gc.collect()
  before = live()
  s = calibrate.layer_compute_seconds(cfg, params, store, steps=3)
  link = calibrate.calibrated_link("scaled", cfg, params, store)
  gc.collect()
  assert s > 0 and link.emulated
  one_layer = cfg.num_experts * store.expert_nbytes()
  assert live() - before < one_layer                 # nothing of it is kept alive
  with pytest.raises(link_lib.LinkSpecError, match="calibrated_link"):
    EngineConfig.make("baseline", link="scaled")   # no hidden benchmark
