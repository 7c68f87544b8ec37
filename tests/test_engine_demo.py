"""OffloadEngine on the shipped demo model (ckpts/demo): budgets below top-k, records that
do not depend on the link, and memory that stays flat over thousands of sampled tokens."""

import dataclasses
import os

import numpy as np
import pytest

from moejax.io.loader import load_model
from moejax.offload import link as link_lib
from moejax.cache import policy as policy_lib
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.model.sampler import SamplingParams

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")
PROMPT = [17, 250, 31, 999, 12, 4000, 77, 5]
STREAM = [int(t) for t in np.random.default_rng(5).integers(1, 8000, 24)]
# substitute every miss and admit in the background: no waited fetch, many admissions
ADMITTING = policy_lib.make_policy("substitute_all", admission_beta=0.5)
N = 2000                     # sampled tokens of the memory test
MAX_LEN = N + 16             # the admitting engines share their programs


@pytest.fixture(scope="module")
def demo():
  if not os.path.exists(os.path.join(DEMO, "config.json")):
    pytest.skip("no demo model at ckpts/demo")
  return load_model(DEMO)


@pytest.mark.parametrize("slots,policy", [(1, "baseline"), (4, "baseline"), (4, "quality")])
def test_budget_below_top_k_is_really_that_small(demo, slots, policy):
  """Between tokens a layer holds at most S experts, the admissions it requested
  included (they are inserted before the trim: cache_fraction=0.0625 is S = 4)."""
  cfg, params, store = demo
  assert slots < cfg.top_k
  with OffloadEngine(cfg, params, store, EngineConfig.make(policy,
                                                           cache_fraction=slots / cfg.num_experts,
                                                           max_len=64)) as eng:
    assert (eng.budget.slots, eng.budget.staging) == (slots, cfg.top_k - slots)
    eng.prefill(PROMPT)
    assert all(len(s) <= slots for s in eng.resident_sets().values())
    for tok in STREAM[:24]:
      eng.decode_step(tok)
      sets = eng.resident_sets()
      assert all(len(s) <= slots for s in sets.values()), sets
    # at most S of a token's K experts can hit: staging slots never carry over
    for r in eng.records:
      assert r.hits <= slots * len(cfg.moe_layers)
      for rec in r.layers.values():
        assert rec.actions.count(0) <= slots
    s = eng.stats()
    assert s["evictions_per_token"] > 0 and s["hit_rate"] <= slots / cfg.top_k
    if policy == "quality":      # the case that held S + 2 between tokens
      assert s["admitted_per_token"] > 0, s


def run(demo, link, tokens):
  cfg, params, store = demo
  with OffloadEngine(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                           link=link, max_len=MAX_LEN)) as eng:
    out = [eng.prefill(PROMPT)] + [eng.decode_step(t) for t in tokens]
    return eng.records, eng.resident_sets(), np.stack(out)


def test_records_and_final_state_do_not_depend_on_the_link(demo):
  # on a slow link the admissions wait; decisions, inserts and outputs are the same
  tokens = STREAM[:20]
  fast = run(demo, "native", tokens)
  slow = run(demo, link_lib.parse_link("5MB/s,50us"), tokens)
  np.testing.assert_array_equal(fast[2], slow[2])
  keys = ("hits", "fetches", "substituted", "admissions", "admitted", "evictions")
  assert [[r[k] for k in keys] for r in fast[0]] == [[r[k] for k in keys] for r in slow[0]]
  assert [r.layers for r in fast[0]] == [r.layers for r in slow[0]]
  assert fast[1] == slow[1]
  assert sum(r.admitted for r in fast[0]) > 0
  assert sum(r.admission_wait_s for r in slow[0]) > 0
  assert all(r.admission_wait_s == 0 for r in fast[0])


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  pytest.skip("no /proc/self/status")


def test_memory_stays_flat_over_thousands_of_sampled_tokens(demo):
  """2,000 sampled tokens with substitution and background admission, through generate's
  on-device loop and through per-token decode steps: after warm-up the process grows by
  at most 32 MB (the newest stats.RECORDS_KEPT records are kept whole, ~4 KB each)."""
  cfg, params, store = demo
  sp = SamplingParams(temperature=1.0, max_new_tokens=N)
  per_token = dict(on_token=lambda t: None)
  with OffloadEngine(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                           max_len=MAX_LEN)) as eng:
    # warm-up: the prompt, the decode step (20 tokens) and the loop (which stops at once
    # at the first token: the stop id it samples first, same shape as no stop id)
    first = eng.generate(PROMPT, dataclasses.replace(sp, max_new_tokens=20), seed=1,
                         **per_token)
    assert eng.generate(PROMPT, dataclasses.replace(sp, stop_ids=(first[0],)), seed=1) == [
        first[0]]
    before = rss_mb()
    looped = eng.generate(PROMPT, sp, seed=2)
    mid = rss_mb()
    stepped = eng.generate(PROMPT, sp, seed=3, **per_token)
    after = rss_mb()
    assert len(looped) == len(stepped) == N
    assert mid - before <= 32 and after - before <= 32, (before, mid, after)
    s = eng.stats(skip=eng.stats()["tokens"] - 2 * (N - 1))   # the two measured runs
    assert s["tokens"] == 2 * (N - 1) and s["admitted_per_token"] > 0.5
    assert s["fetches_per_token"] == 0
