"""The one-call prefetch layer (`prefetch_steps.decide_steps`): a MoE layer's moe call, the
next layer's decision and the prediction of the layer after it as one jitted call give the
same run as separate calls.  Its own file (own pytest process): see tests/prefetch_cases.py."""

import numpy as np
import pytest

from tests.prefetch_cases import PROMPT, STREAM, run_engine, tiny_model, with_estimators


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.mark.parametrize("kw", [
    dict(policy="baseline", streaming=True, prefetch="hybrid", speculative="true_router"),
    dict(policy="quality", cache_fraction=0.5, prefetch="hybrid", speculative="predicted_weights"),
    dict(policy="speed", cache_fraction=0.25, prefetch="quasi", speculative="off"),
    dict(policy="baseline", streaming=True, prefetch="previous", speculative="predicted_weights"),
    dict(policy="baseline", streaming=True, prefetch="hybrid", speculative="predicted_weights",
         previous=True),
], ids=["stream-hybrid-true", "quality-hybrid-predicted", "speed-quasi", "stream-previous",
        "stream-hybrid-estimators-prev"])
def test_one_call_per_layer_equals_separate_calls(model, kw):
  """With prefetch on, a MoE layer's moe call, the next layer's decision and the
  prediction of the layer after it run as one call (`prefetch_steps.decide_steps`):
  the same logits, decisions, prefetches and resident sets as separate calls."""
  cfg, params, store, _ = model
  kw = dict(kw, predictors=with_estimators(cfg, previous=kw.pop("previous", False)))
  runs = [run_engine(cfg, params, store, PROMPT, STREAM, fuse_layers=f, **kw) for f in (True, False)]
  (eng_f, out_f, _), (eng_s, out_s, _) = runs
  np.testing.assert_array_equal(out_f, out_s)
  assert eng_f.resident_sets() == eng_s.resident_sets()
  for a, b in zip(eng_f.records, eng_s.records):
    for l in cfg.moe_layers:
      la, lb = a.layers[l], b.layers[l]
      assert (la.actions, la.ids, la.predicted, la.prefetched, la.true_ids) == (
          lb.actions, lb.ids, lb.predicted, lb.prefetched, lb.true_ids)
    assert (a.prefetches, a.useful_prefetches, a.fetches, a.admissions) == (
        b.prefetches, b.useful_prefetches, b.fetches, b.admissions)
  assert sum(r.prefetches for r in eng_f.records) > 0
