"""Speculative prefetch in the engine (issue 13): modes, exactness, statistics, agreement with
the emulator, bad input."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model import routing
from moejax.prefetch import speculation
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer
from moejax.cache import policy as P
from moejax.prefetch import steps as prefetch_lib
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.prefetch.steps import Prefetch
from moejax.io.traces import config_hash
from tests import tiny_models

PROMPT = [3, 17, 5, 60, 22]
STREAM = [int(t) for t in np.random.default_rng(3).integers(0, 64, 10)]


@pytest.fixture(scope="module")
def model():
  """A tiny qwen3_moe model with three MoE layers and its fully resident logits."""
  cfg = tiny_models.tiny_config((True, True, True))
  store = tiny_models.random_store(cfg, np.random.default_rng(0), 0.2)
  seq = jnp.asarray([PROMPT + STREAM], jnp.int32)
  mdl = Transformer(cfg)
  params = jax.jit(lambda k: mdl.init(k, seq, store.to_device())["params"])(
      jax.random.PRNGKey(0))
  logits, _, _ = jax.jit(lambda p, e: mdl.apply({"params": p}, seq, e))(params,
                                                                       store.to_device())
  return cfg, params, store, np.asarray(logits[0, len(PROMPT) - 1:])


def _vectors(cfg, seed=1):
  rng = np.random.default_rng(seed)
  return {"vectors": [rng.standard_normal((cfg.num_experts, cfg.hidden_size)).astype(np.float32)
                      * 0.1 for _ in cfg.moe_layers],
          "estimators": [None] * (len(cfg.moe_layers) - 1)}


def _run(cfg, params, store, prompt, stream, prefetch="none", speculative="off",
         predictors=None, streaming=False, **kw):
  """An engine run with `Prefetch(prefetch, speculative, predictors, streaming)` -> (engine,
  logits [1 + len(stream), V], the final resident sets)."""
  kw.setdefault("cache_fraction", 0.25)
  pf = Prefetch(prefetch, speculative, predictors, streaming)
  config = EngineConfig.make(kw.pop("policy", "baseline"), max_len=32, prefetch=pf, **kw)
  with OffloadEngine(cfg, params, store, config) as eng:
    eng.warmup()
    out = [eng.prefill(prompt)] + [eng.decode_step(t) for t in stream]
    sets = eng.resident_sets()
  return eng, np.stack(out), sets


def with_estimators(cfg, seed=2, previous=False):
  """Default vectors and a random (non-zero) estimator on every layer pair (`previous`:
  estimators that also take the previous token's router probabilities)."""
  from moejax.prefetch.estimator import LogitCorrection
  preds = _vectors(cfg)
  est = []
  for j in range(len(cfg.moe_layers) - 1):
    mod = LogitCorrection(cfg.num_experts, 8)
    width = cfg.hidden_size + (cfg.num_experts if previous else 0)
    q, base = jnp.zeros((1, width)), jnp.zeros((1, cfg.num_experts))
    p = mod.init(jax.random.PRNGKey(seed + j), q, base)
    p = jax.tree_util.tree_map(lambda a: a + 0.3, p)
    w_out = jax.random.normal(jax.random.PRNGKey(seed + 100 + j), (8, cfg.num_experts))
    p["params"]["w_out"]["kernel"] = w_out      # a real correction: moves the ranking
    if previous:   # weigh the previous token's probabilities enough to move predictions
      k = p["params"]["w_in"]["kernel"]
      p["params"]["w_in"]["kernel"] = k.at[cfg.hidden_size:].multiply(30.0)
    est.append(p)
  return dict(preds, estimators=est, sources=["estimator"] * len(est))


def _cfg(**kw):
  base = dict(vocab_size=8, hidden_size=4, num_layers=1, num_heads=1, num_kv_heads=1,
              head_dim=4, moe_intermediate_size=4, intermediate_size=4, sparse_layers=(True,),
              num_experts=4, top_k=2)
  return ModelConfig(**dict(base, **kw))


def test_restricted_gates_hand_checked():
  cfg = _cfg(model_type="olmoe", norm_topk_prob=False)
  logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.3, 0.4]]))
  g = prefetch_lib.restricted_gates(cfg, logits, jnp.asarray([[0, 2]]))
  np.testing.assert_allclose(np.asarray(g), [[0.1, 0.3]], rtol=1e-6)   # p[ids], not renormalised
  cfg_n = _cfg(model_type="qwen3_moe", norm_topk_prob=True)
  g = prefetch_lib.restricted_gates(cfg_n, logits, jnp.asarray([[0, 2]]))
  np.testing.assert_allclose(np.asarray(g), [[0.25, 0.75]], rtol=1e-6)
  ids, gates, _ = routing.route(cfg_n, logits)                          # the true top-k: route's
  np.testing.assert_allclose(np.asarray(prefetch_lib.restricted_gates(cfg_n, logits, ids)),
                             np.asarray(gates), rtol=1e-6)


def test_quasi_offset_and_view_hand_checked():
  vec = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
  d = prefetch_lib.quasi_offset(jnp.asarray([1, -1, 0]), jnp.asarray([0.5, 9.0, 0.25]), vec)
  np.testing.assert_allclose(np.asarray(d), [0.25, 0.5])                # -1 (nothing run) skipped
  from moejax.cache import resident as R
  st = R.init_state(4, 2, {}, buffers=False)
  st = st.__class__(**{**st.__dict__, "expert_slot": jnp.asarray([-1, 0, -1, -1]),
                       "slot_expert": jnp.asarray([1, -1])})
  v = prefetch_lib.view(st, jnp.asarray([3, 1, -1]))
  # expert 3 -> row P + 1 + 0 = 3; expert 1 already in slot 0 keeps it; -1 ignored
  np.testing.assert_array_equal(np.asarray(v.expert_slot), [-1, 0, -1, 3])


@pytest.mark.parametrize("speculative,streaming", [("predicted_weights", True),
                                                   ("true_router", False)])
def test_speculative_with_true_predictions_is_exact(model, speculative, streaming):
  """The oracle predicts each layer's true routing: speculative execution then runs the
  exact model, and every prediction is prefetched and used."""
  cfg, params, store, ref = model
  eng, out, _ = _run(cfg, params, store, PROMPT, STREAM, prefetch="oracle",
                     speculative=speculative, streaming=streaming)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
  s = eng.stats()
  assert s["recall_at_k"] == 1.0
  assert s["prefetches_per_token"] > 0
  assert s["useful_prefetches_per_token"] == s["prefetches_per_token"]
  assert s["wasted_bytes_per_token"] == 0
  if streaming:   # nothing kept: every layer after the first is served by prefetches
    assert s["fetches_per_token"] == cfg.top_k
    assert s["prefetches_per_token"] == cfg.top_k * (len(cfg.moe_layers) - 1)


@pytest.mark.parametrize("prefetch", ["reuse", "quasi"])
def test_prefetch_without_speculation_is_exact_and_counts(model, prefetch):
  """Without speculative execution a misprediction goes through the miss rule (fetch):
  the output is the exact model's whatever the predictor."""
  cfg, params, store, ref = model
  eng, out, _ = _run(cfg, params, store, PROMPT, STREAM, prefetch=prefetch, streaming=True,
                     predictors=_vectors(cfg))
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
  for r in eng.records:
    for l in cfg.moe_layers[1:]:
      lr = r.layers[l]
      assert len(lr.predicted) == cfg.top_k and lr.prefetched == lr.predicted  # nothing kept
      fetched = set(lr.fetched)
      assert fetched == set(lr.ids) - set(lr.predicted)    # the mispredicted ones, no more
    assert r.useful_prefetches == sum(len(set(r.layers[l].ids) & set(r.layers[l].predicted))
                                      for l in cfg.moe_layers[1:])
    assert r.wasted_bytes <= (r.prefetches - r.useful_prefetches) * store.expert_nbytes()


def test_previous_predicts_the_layers_selection_at_the_previous_token(model):
  """`previous`: layer l+1's prediction is its own true top-k at the previous token (none
  for the first decoded token after a prompt); without speculation the output is exact
  and exactly the mispredicted experts are fetched."""
  cfg, params, store, ref = model
  eng, out, _ = _run(cfg, params, store, PROMPT, STREAM, prefetch="previous", streaming=True)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
  recs = eng.records
  for l in cfg.moe_layers:
    assert not recs[0].layers[l].predicted          # nothing before the first decoded token
  for prev, r in zip(recs, recs[1:]):
    assert not r.layers[cfg.moe_layers[0]].predicted    # the first MoE layer: no pair
    for l in cfg.moe_layers[1:]:
      assert r.layers[l].predicted == prev.layers[l].true_ids
      assert set(r.layers[l].fetched) == set(r.layers[l].ids) - set(r.layers[l].predicted)
  # a new prompt forgets the previous sequence's last token
  config = EngineConfig.make("baseline", max_len=32,
                             prefetch=Prefetch("previous", streaming=True))
  with OffloadEngine(cfg, params, store, config) as eng2:
    eng2.prefill(PROMPT)
    eng2.decode_step(STREAM[0])
    eng2.prefill(PROMPT)
    eng2.decode_step(STREAM[0])
  assert not any(eng2.records[-1].layers[l].predicted for l in cfg.moe_layers)


def test_estimator_takes_the_previous_tokens_routing(model):
  """An estimator with the previous token's input gets layer l+1's true logits at the
  previous decoded token (none at the first one after a prompt): the engine's predictions
  equal the estimator applied to the teacher-forced (q, quasi logits, previous token's
  true logits) -- and differ from it fed no previous token.  Speculation off: exact."""
  from moejax.prefetch.estimator import estimate
  cfg, params, store, ref = model
  preds = with_estimators(cfg, previous=True)
  eng, out, _ = _run(cfg, params, store, PROMPT, STREAM, prefetch="hybrid", streaming=True,
                     predictors=preds)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
  pairs = speculation.predictions(cfg, params, store.to_device(),
                                  [jnp.asarray(v) for v in preds["vectors"]],
                                  jnp.asarray([PROMPT + STREAM]))
  t = len(PROMPT) + np.arange(len(STREAM))           # the decoded tokens' positions
  has = jnp.asarray(np.arange(len(STREAM)) > 0)
  differs = False
  for j, l in enumerate(cfg.moe_layers[1:]):
    q, quasi, true = (np.asarray(pairs[j][k], np.float32) for k in ("q", "quasi", "true"))
    want = np.asarray(routing.route(cfg, estimate(preds["estimators"][j], q[t], quasi[t],
                                                  true[t - 1], has))[0])
    blind = np.asarray(routing.route(cfg, estimate(preds["estimators"][j], q[t], quasi[t],
                                                   true[t - 1], has & False))[0])
    got = np.asarray([r.layers[l].predicted for r in eng.records])
    np.testing.assert_array_equal(np.sort(got, 1), np.sort(want, 1))
    differs |= bool(np.any(np.sort(got, 1) != np.sort(blind, 1)))
  assert differs


def test_hybrid_sources_and_previous_agreement_hand_checked():
  from moejax.cli.prepare.train_estimators import choose_source
  from moejax.prefetch.speculation import previous_token_agreement
  rec = {"quasi": 0.5, "estimator": 0.7, "previous": 0.9}
  assert choose_source(0.3, 0.0, rec) == "previous"
  assert choose_source(0.3, 0.0, dict(rec, previous=0.6)) == "estimator"
  assert choose_source(0.3, 0.5, dict(rec, previous=0.4)) == "quasi"    # drift below threshold
  assert choose_source(0.9, 0.0, {"quasi": 0.8, "estimator": 0.8, "previous": 0.8}) == "quasi"
  cfg = _cfg(model_type="qwen3_moe", num_experts=4, top_k=2, norm_topk_prob=True)
  # two windows of 3 tokens: top-2 sets {0,1} {0,2} {0,2} | {3,2} {1,0} {1,0}
  lg = np.full((6, 4), -5.0, np.float32)
  for t, ids in enumerate([(0, 1), (0, 2), (0, 2), (3, 2), (1, 0), (1, 0)]):
    lg[t, list(ids)] = [2.0, 1.0]
  a = previous_token_agreement(cfg, lg, seq=3)   # pairs (1|0) (2|1) (4|3) (5|4), not (3|2)
  assert a["recall_at_k"] == pytest.approx((1 + 2 + 0 + 2) / 8)
  assert a["exact_match"] == pytest.approx(2 / 4)


def test_speculative_with_a_wrong_predictor_runs_the_predicted_set(model):
  cfg, params, store, ref = model
  eng, out, _ = _run(cfg, params, store, PROMPT, STREAM, prefetch="reuse",
                     speculative="predicted_weights", streaming=True)
  for r in eng.records:
    for l in cfg.moe_layers[1:]:
      assert sorted(r.layers[l].ids) == sorted(r.layers[l].predicted)    # executed = predicted
      assert not r.layers[l].fetched                                      # never refetched
  assert eng.stats()["recall_at_k"] < 1.0 or np.allclose(out, ref, atol=2e-5)


@pytest.mark.parametrize("policy", ["quality"])
def test_cache_preset_with_prefetch(model, policy):
  """With a cache, the executed prefetches are inserted like fetches, within the budget;
  a prefetch is requested only for a predicted expert that is not resident."""
  cfg, params, store, _ = model
  eng, out, sets = _run(cfg, params, store, PROMPT, STREAM, policy=policy, prefetch="quasi",
                        predictors=_vectors(cfg), cache_fraction=0.5)
  chex.assert_tree_all_finite(out)
  assert all(len(s) <= eng.budget.slots for s in sets.values())
  for r in eng.records:
    used = 0
    for l in cfg.moe_layers[1:]:
      lr = r.layers[l]
      assert set(lr.prefetched) <= set(lr.predicted)
      executed = ({e for e, a in zip(lr.ids, lr.actions) if a in (P.HIT, P.FETCH)}
                  | {e for e in lr.substitutes if e >= 0})
      assert not set(lr.prefetched) & set(lr.fetched)    # a prefetched expert is not fetched
      used += len(set(lr.prefetched) & executed)
    assert r.useful_prefetches == used
  assert sum(r.useful_prefetches for r in eng.records) > 0


def _save_vectors(tmp_path, cfg, h=None):
  d = tmp_path / "m-estimators"
  speculation.save_default_vectors(str(d / "default_vectors"), _vectors(cfg)["vectors"],
                       [np.ones(cfg.num_experts)] * len(cfg.moe_layers),
                       {"config_hash": h or config_hash(cfg)})
  return tmp_path / "m", d


def test_missing_or_foreign_predictor_files_are_refused(model, tmp_path):
  cfg = model[0]
  with pytest.raises(speculation.PrefetchError, match="moejax-default-vectors"):
    speculation.load_predictors("quasi", cfg, str(tmp_path / "none"))
  m, d = _save_vectors(tmp_path, cfg, h="0123456789abcdef")
  with pytest.raises(speculation.PrefetchError, match="another model"):
    speculation.load_predictors("quasi", cfg, str(m))
  m, d = _save_vectors(tmp_path, cfg)
  assert len(speculation.load_predictors("quasi", cfg, str(m))["vectors"]) == 3
  with pytest.raises(speculation.PrefetchError, match="moejax-train-estimators"):
    speculation.load_predictors("hybrid", cfg, str(m))
  (d / "estimators.json").write_text(json.dumps({"config_hash": "feedfeedfeedfeed"}))
  with pytest.raises(speculation.PrefetchError, match="another model"):
    speculation.load_predictors("hybrid", cfg, str(m))
  # estimators whose input is neither q [D] nor [q, previous probabilities] [D + E], or
  # a mix of the two
  import orbax.checkpoint as ocp
  meta = {"config_hash": config_hash(cfg),
          "per_layer": [{"hybrid_source": "estimator", "hybrid_uses_estimator": True}] * 2}
  (d / "estimators.json").write_text(json.dumps(meta))
  good, prev = with_estimators(cfg)["estimators"], with_estimators(cfg, previous=True)["estimators"]
  bad = {"params": dict(good[0]["params"], w_in={"kernel": jnp.zeros((cfg.hidden_size + 3, 8)),
                                                 "bias": jnp.zeros(8)})}
  for pairs, msg in (([bad, good[1]], "takes 35 inputs"), ([good[0], prev[1]], "differ in shape")):
    with ocp.StandardCheckpointer() as ck:
      ck.save(str(d / "estimators"), {"pairs": pairs}, force=True)
    with pytest.raises(speculation.PrefetchError, match=msg):
      speculation.load_predictors("hybrid", cfg, str(m))
  with ocp.StandardCheckpointer() as ck:
    ck.save(str(d / "estimators"), {"pairs": prev}, force=True)
  assert speculation.load_predictors("hybrid", cfg, str(m))["estimators"][1] is not None
  with pytest.raises(ValueError, match="--speculative"):
    EngineConfig.make(prefetch=Prefetch(speculative="true_router"))
  with pytest.raises(ValueError, match="--prefetch must be"):
    prefetch_lib.Mode("sometimes")


@pytest.mark.parametrize("kw", [
    dict(policy="baseline", streaming=True, prefetch="quasi", speculative="predicted_weights"),
    dict(policy="baseline", streaming=True, prefetch="reuse", speculative="true_router"),
    dict(policy="quality", cache_fraction=0.5, prefetch="quasi", speculative="off"),
    dict(policy="speed", cache_fraction=0.25, prefetch="previous", speculative="off"),
    dict(policy="baseline", streaming=True, prefetch="hybrid", speculative="true_router",
         sources=["previous", "quasi"]),
    dict(policy="quality", cache_fraction=0.5, prefetch="hybrid", speculative="predicted_weights",
         sources=["estimator", "estimator"]),
], ids=["stream-quasi-predicted", "stream-reuse-true", "quality-quasi", "speed-previous",
        "stream-hybrid-previous-quasi-true", "quality-hybrid-estimators-prev"])
def test_emulator_prefetch_equals_the_engine(model, kw):
  """The one emulator runs the engine's prefetch and speculative decisions: same logits,
  same per-layer actions, fetches, evictions and prefetch counts."""
  from tests.test_emulator import assert_same_decisions, emulator_run, engine_run
  cfg, params, store, _ = model
  sources = kw.pop("sources", None)
  preds = (with_estimators(cfg, previous=True) if sources and "estimator" in sources
           else _vectors(cfg))    # estimators that take the previous token's routing
  kw = dict(kw, predictors=dict(preds, **({"sources": sources} if sources else {})))
  policy = kw.pop("policy")
  toks = PROMPT[:1] + STREAM
  ref, records, final = engine_run(cfg, params, store, policy, toks, **kw)
  logits, out = emulator_run(cfg, params, store, policy, toks, **kw)
  np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=1e-5)
  assert_same_decisions(cfg, records, out)
  assert final == {l: sorted(int(e) for e in out["slot_expert"][0, -1, j] if e >= 0)
                   for j, l in enumerate(cfg.moe_layers)}
  assert sum(r.prefetches for r in records) > 0


def test_shipped_predictors_load_for_the_shipped_demo_model():
  """ckpts/demo-estimators must match ckpts/demo's config hash (a config field added or
  removed changes the hash; the shipped files then need their hash re-stamped)."""
  from moejax.model.config import ModelConfig
  from moejax.prefetch.speculation import load_predictors
  cfg = ModelConfig.from_json_file("ckpts/demo/config.json")
  out = load_predictors("hybrid", cfg, "ckpts/demo")
  assert len(out["vectors"]) == len(cfg.moe_layers)
  assert any(e is not None for e in out["estimators"])
