"""OffloadEngine invariants on a tiny random model (DESIGN.md, issue 4 part 6)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.loader import expert_shapes
from moejax.model import Transformer
from moejax.offload import calibrate
from moejax.offload import stats as stats_lib
from moejax.offload import steps as steps_lib
from moejax.offload import link as link_lib
from moejax.offload import policy as P
from moejax.offload import resident as R
from moejax.offload.engine import OffloadEngine
from moejax.store import ExpertStore

PROMPT = [3, 17, 5, 60, 22]
STREAM = [int(t) for t in np.random.default_rng(3).integers(0, 64, 14)]


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=16, intermediate_size=48,
                    sparse_layers=(True, False, True), qk_norm="head",
                    norm_topk_prob=True).validate()
  rng = np.random.default_rng(0)
  exps = [None if not s else
          {k: (rng.standard_normal((8,) + shp) * 0.2).astype(np.float32)
           for k, shp in expert_shapes(cfg).items()} for s in cfg.sparse_layers]
  store = ExpertStore.from_stacked(exps)
  model = Transformer(cfg)
  seq = jnp.asarray([PROMPT + STREAM], jnp.int32)
  # one jitted init and one jitted teacher-forced forward of the fully resident model
  params = jax.jit(lambda k: model.init(k, seq, store.to_device())["params"])(
      jax.random.PRNGKey(0))
  logits, _, _ = jax.jit(lambda p, e: model.apply({"params": p}, seq, e))(params,
                                                                         store.to_device())
  ref = np.asarray(logits[0, len(PROMPT) - 1:])               # prefill's last, then each decode
  return cfg, params, store, ref


def run(model, policy, check=None, **kw):
  cfg, params, store, _ = model
  kw.setdefault("cache_fraction", 0.25)
  with OffloadEngine(cfg, params, store, policy, max_len=32, **kw) as eng:
    eng.warmup()                                   # compiles on throwaway state only
    out = [eng.prefill(PROMPT)]
    for tok in STREAM:
      out.append(eng.decode_step(tok))
      if check:
        check(eng)
  return eng, np.stack(out)


def check_budget(eng):
  for layer, st in eng.states.items():
    se, es = np.asarray(st.slot_expert), np.asarray(st.expert_slot)
    assert (se >= 0).sum() <= eng.budget.slots     # staging slots are drained after a token
    assert (es >= 0).sum() == (se >= 0).sum()
    for s, e in enumerate(se):
      if e >= 0:
        assert es[e] == s
        np.testing.assert_array_equal(np.asarray(st.buffers["down"][s]),
                                      eng.store.get(layer, int(e))["down"])


def test_fetch_all_matches_fully_resident_model_and_keeps_budget(model):
  eng, out = run(model, "baseline", check=check_budget)
  np.testing.assert_allclose(out, model[3], atol=1e-6, rtol=0)
  st = eng.stats()
  assert st["fetches_per_token"] > 0 and st["hit_rate"] < 1      # the cache really missed
  assert st["substituted_call_pct"] == 0
  for r in eng.records:
    assert r["hits"] + r["misses"] == r["expert_calls"] == 2 * 2   # K x MoE layers
    assert r["fetches"] == r["misses"]
  assert eng.prefill_record["fetches"] > 0


def test_staging_slots_when_budget_is_below_top_k(model):
  eng, out = run(model, "baseline", cache_fraction=0.125, check=check_budget)  # S=1 < K=2
  assert (eng.budget.slots, eng.budget.staging) == (1, 1)
  np.testing.assert_allclose(out, model[3], atol=1e-6, rtol=0)


def test_host_policy_computes_misses_exactly_on_the_host(model):
  eng, out = run(model, "host")
  np.testing.assert_allclose(out, model[3], atol=1e-5, rtol=0)
  st = eng.stats()
  assert st["host_calls_per_token"] > 0 and st["fetches_per_token"] == 0
  assert st["host_ms_per_token"] > 0


def test_full_budget_fetches_nothing_after_warm_up(model):
  cfg, params, store, ref = model
  with OffloadEngine(cfg, params, store, "baseline", cache_fraction=1.0, initial="empty",
                     max_len=32) as eng:
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
  np.testing.assert_allclose(out2, model[3], atol=1e-6, rtol=0)


def test_substituting_presets_count_consistently_and_are_deterministic(model):
  link = link_lib.parse_link("2GB/s,20us")
  eng, out = run(model, "quality", check=check_budget, link=link)
  eng_b, out_b = run(model, "quality", link=link)
  np.testing.assert_array_equal(out, out_b)
  keys = ("hits", "misses", "fetches", "substituted", "admissions", "admitted", "evictions")
  assert [[r[k] for k in keys] for r in eng.records] == [[r[k] for k in keys]
                                                        for r in eng_b.records]
  sub, _ = run(model, "substitute_all", check=check_budget)
  s = sub.stats()
  assert s["fetches_per_token"] == 0 and s["substituted_call_pct"] > 0
  assert 0 < s["substituted_mass_per_token"] <= 2.0 + 1e-6
  for r in sub.records:
    assert r["hits"] + r["misses"] == r["expert_calls"]
    assert r["substituted"] + r["dropped"] + r["fetches"] + r["host_calls"] == r["misses"]


def test_results_do_not_depend_on_link_speed_or_thread_timing(model):
  # admissions arrive at different times on these links, so some are inserted while
  # a fetch crosses the link and some before their own layer: same inserts either way
  keys = ("hits", "fetches", "substituted", "admissions", "admitted", "evictions")
  policy = P.make_policy("quality", tau=0.6, admission_beta=0.2)  # admits on this tiny model
  runs = [run(model, policy, link=link) for link in
          ("native", link_lib.parse_link("1MB/s,50us"))]
  (fast, out_fast), (slow, out_slow) = runs
  np.testing.assert_array_equal(out_fast, out_slow)
  assert [[r[k] for k in keys] for r in fast.records] == [[r[k] for k in keys]
                                                          for r in slow.records]
  assert sum(r["admitted"] for r in fast.records) > 0


def test_emulated_link_waits_at_least_the_transfer_time(model):
  cfg, params, store, _ = model
  link = link_lib.parse_link("1MB/s,100us")          # one 6 KiB expert: >= 6.2 ms
  eng, _ = run(model, "baseline", link=link)
  s = eng.stats()
  per_fetch = link.transfer_time(store.expert_nbytes())
  assert s["fetches_per_token"] > 0
  # the fetched rows are inserted while their link time elapses, so the wait is shorter
  # than the link time; the token still lasts at least its fetches' link time
  for r in eng.records:
    assert r["wall_s"] >= per_fetch * r["fetches"] and r["wait_s"] > 0
  p = eng.transfer_stats()
  assert p["link_busy_s"] >= 0.999 * per_fetch * p["transfers"] > 0
  assert eng.link.describe() in stats_lib.format_stats(s, eng.link.describe())


def test_bad_inputs_name_the_flag(model):
  cfg, params, store, _ = model
  with pytest.raises(P.PolicyError, match="--policy"):
    OffloadEngine(cfg, params, store, "turbo")
  with pytest.raises(R.BudgetError, match="--cache_fraction"):
    OffloadEngine(cfg, params, store, "baseline", cache_fraction=0.01)
  with pytest.raises(link_lib.LinkSpecError, match="--link"):
    OffloadEngine(cfg, params, store, "baseline", link="fast please")


def test_a_failing_transfer_stops_the_run_with_a_clear_error(model):
  from moejax.offload.tickets import TransferError
  cfg, params, store, _ = model

  class BrokenStore:
    def __init__(self, inner):
      self.inner = inner
      self.layers, self.num_layers = inner.layers, inner.num_layers

    def __getattr__(self, name):
      return getattr(self.inner, name)

    def get(self, layer, expert):
      if expert == 7:
        raise OSError(f"cannot read expert {expert} of layer {layer}")
      return self.inner.get(layer, expert)

  with pytest.raises(TransferError, match="cannot read expert 7"):
    with OffloadEngine(cfg, params, BrokenStore(store), "fetch_all", cache_fraction=0.25,
                       max_len=32) as eng:
      eng.prefill(list(range(8)) * 2)
      for t in STREAM:
        eng.decode_step(t)
  assert not eng.transfer_stats()["alive"]


def test_profile_initial_contents(model):
  cfg, params, store, ref = model
  counts = calibrate.profile_counts(cfg, params, store, PROMPT + STREAM)
  with OffloadEngine(cfg, params, store, "quality", cache_fraction=0.25, max_len=32,
                     initial="profile", profile_counts=counts) as eng:
    for layer, experts in eng.resident_sets().items():
      top = R.profile_order(counts[layer])[:eng.budget.slots]
      assert experts == sorted(top)
    eng.prefill(PROMPT)
    for t in STREAM:
      eng.decode_step(t)
    check_budget(eng)
    for r in eng.records:
      assert r["hits"] + r["misses"] == r["expert_calls"]
      assert r["admitted"] <= sum(x["admissions"] for x in eng.records)


def test_decode_compiles_once_per_layer_kind(model):
  cfg, params, store, _ = model
  policy = P.make_policy("speed", lfu_decay=0.5)     # its own compile-cache keys
  kinds = {steps_lib.layer_kind(cfg, i): steps_lib.layer_steps(
      cfg, jnp.float32, i, policy.decision, policy.cache, None) for i in range(cfg.num_layers)}
  sizes = lambda: {k: {n: f._cache_size() for n, f in st._asdict().items() if f is not None}
                   for k, st in kinds.items()}
  with OffloadEngine(cfg, params, store, policy, cache_fraction=0.25, max_len=32) as eng:
    eng.warmup()
    before = sizes()
    eng.prefill(PROMPT)
    after_prefill = sizes()
    for t in STREAM:                       # two MoE layers and a dense layer per token
      eng.decode_step(t)
    assert sizes() == after_prefill        # no decode step compiled again
    for (sparse, _), fns in before.items():
      if not sparse:
        assert fns["dense_decode"] == 1
        continue
      assert fns["attend_decide"] == 1 and fns["moe"] == 1
      # one per row bucket (K = 2: one) and per kind of rows: host stacks (the CPU
      # backend's copies) or device arrays (gathered across groups)
      assert fns["insert_attend_decide"] == 2 and fns["insert"] == 2


def test_trace_marks_every_layer_in_order_and_the_link_wait(model):
  cfg, params, store, _ = model
  link = link_lib.parse_link("10MB/s", expert_bytes=store.expert_nbytes())
  with OffloadEngine(cfg, params, store, "baseline", cache_fraction=0.25, max_len=32,
                     link=link, run_layers=False) as eng:     # one call per layer
    eng.prefill(PROMPT)
    eng.decode_step(STREAM[0])
    assert eng.traces == []                           # off by default
    eng.trace = True
    for tok in STREAM[1:6]:
      eng.decode_step(tok)
  assert len(eng.traces) == 5
  fetch_layers = 0
  for tr, rec in zip(eng.traces, eng.records[1:]):
    times = [t for _, _, t in tr]
    assert times == sorted(times) and tr[0][0] == "start" and tr[-1][0] == "end"
    assert abs(times[-1] - times[0] - rec["wall_s"]) < 1e-12
    evs = [(ev, l) for ev, l, _ in tr]
    assert ("dense", 1) in evs
    for l in (0, 2):
      mine = [ev for ev, ll in evs if ll == l]
      assert mine in (["attend", "decided", "moe", "moe_done"],
                      ["attend", "decided", "fetch", "arrived", "moe", "moe_done"])
      if "fetch" in mine:
        fetch_layers += 1
        at = {ev: t for ev, ll, t in tr if ll == l}
        assert at["arrived"] - at["fetch"] >= link.transfer_time(store.expert_nbytes())
    assert evs.index(("head", -1)) == len(evs) - 2
  assert 0 < fetch_layers <= sum(r["fetches"] for r in eng.records[1:])


# ------------------------------------------------ memory, timeouts, shutdown (issue 11)
def prefetch_threads() -> int:
  import threading
  return sum(t.name == "moejax-prefetch" and t.is_alive() for t in threading.enumerate())


def test_background_transfers_are_released_over_thousands_of_sampled_tokens(model):
  from moejax.sampler import SamplingParams
  cfg, params, store, _ = model
  policy = P.make_policy("substitute_all", admission_beta=0.3)    # no sync fetch, ever
  n = 1500
  with OffloadEngine(cfg, params, store, policy, cache_fraction=0.25, max_len=n + 16) as eng:
    peak = [0]
    track = lambda _: peak.__setitem__(0, max(peak[0], eng.held_bytes()))
    out = eng.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=n), seed=1,
                       on_token=track)
    assert len(out) == n
    admitted = sum(r.admitted for r in eng.records)
    assert admitted > n // 4                          # plenty of background transfers
    # at most one transfer per (layer, expert) in flight, each padded to K rows
    bound = len(cfg.moe_layers) * (cfg.num_experts + cfg.top_k) * store.expert_nbytes()
    assert peak[0] <= bound
    assert eng.transfer_stats()["bytes"] > 20 * bound     # far more than the bound crossed


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
    OffloadEngine(cfg, params, store, "baseline", link="scaled")   # no hidden benchmark


class HangingStore:
  """Copies on the prefetch thread block until `gate` opens (a transfer that hangs)."""

  def __init__(self, inner, gate):
    import threading
    self.inner, self.gate = inner, gate
    self.entered = threading.Event()      # the prefetch thread is stuck in a copy
    self.layers, self.num_layers = inner.layers, inner.num_layers

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def get(self, layer, expert):
    import threading
    if threading.current_thread().name == "moejax-prefetch":
      self.entered.set()
      self.gate.wait(30)
    return self.inner.get(layer, expert)


def test_a_transfer_that_never_completes_raises_instead_of_hanging(model):
  import threading
  from moejax.offload.tickets import TransferError
  cfg, params, store, _ = model
  gate = threading.Event()
  policy = P.make_policy("substitute_all", admission_beta=0.05)  # admits at once
  try:
    with OffloadEngine(cfg, params, HangingStore(store, gate), policy, cache_fraction=0.25,
                       max_len=32, transfer_timeout_s=0.5) as eng:
      eng.warmup()
      eng.prefill(PROMPT)
      t0 = time.perf_counter()
      with pytest.raises(TransferError, match=r"layer \d+ expert \d+"):
        for tok in STREAM:
          eng.decode_step(tok)
      assert time.perf_counter() - t0 < 25        # the store would release it after 30 s
      gate.set()
      eng.close(timeout=30)                 # the released copy finishes, the thread stops
  finally:
    gate.set()


def test_close_failure_is_noted_on_the_propagating_error_not_swallowed(model):
  import threading
  cfg, params, store, _ = model
  gate = threading.Event()
  policy = P.make_policy("substitute_all", admission_beta=0.05)
  try:
    hanging = HangingStore(store, gate)
    with pytest.raises(ValueError) as e:
      with OffloadEngine(cfg, params, hanging, policy, cache_fraction=0.25,
                         max_len=32, transfer_timeout_s=0.2) as eng:
        eng.prefill(PROMPT)
        eng.decode_step(STREAM[0])        # requests admissions: the thread is stuck on them
        # (on a loaded machine the thread may not have reached the copy yet: wait for it,
        # else close() finds it idle and stops it cleanly, with nothing to note)
        assert hanging.entered.wait(30)
        raise ValueError("caller bug")
    assert any("did not stop" in n for n in getattr(e.value, "__notes__", []))
  finally:
    gate.set()


def test_an_engine_never_closed_stops_its_thread_when_collected(model):
  import gc
  import threading
  cfg, params, store, _ = model
  gc.collect()                       # engines left by earlier tests stop their threads now
  others = {t for t in threading.enumerate() if t.name == "moejax-prefetch"}
  eng = OffloadEngine(cfg, params, store, "quality", cache_fraction=0.25, max_len=32)
  eng.prefill(PROMPT)
  eng.decode_step(STREAM[0])
  ours = [t for t in threading.enumerate() if t.name == "moejax-prefetch" and t not in others]
  assert len(ours) == 1 and ours[0].is_alive()
  del eng
  gc.collect()
  ours[0].join(timeout=10)
  assert not ours[0].is_alive()
