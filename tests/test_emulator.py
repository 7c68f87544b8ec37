"""The exact emulator: agreement with OffloadEngine, exactness, controls, bad input."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.research import emulator as E
from moejax.io.loader import load_model
from moejax.model.model import Transformer
from moejax.cache import policy as P
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.prefetch.steps import Prefetch
from tests import tiny_models

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")
# every preset and miss rule (fetch_all is baseline's rule: baseline covers it), and the
# drop variant of substitution
POLICIES = {name: name for name in ("baseline", "quality", "speed", "threshold", "first_choice",
                                    "substitute_all", "host")}
POLICIES["drop"] = P.make_policy("quality", substitution="drop")
POLICIES["least_stale"] = P.make_policy("quality", eviction="least_stale")
# low-precision fetches (int8; int4 with admission upgrading low slots) and the cost model
POLICIES["fetch_low"] = P.make_policy("fetch_low")
POLICIES["threshold_low"] = P.make_policy("threshold_low", tau=0.3, tau_low=0.1, low_bits=4,
                                          admission_beta=0.3)
POLICIES["cost"] = P.make_policy("cost", lam=2.0, low_bits=4)
PREFETCH_KW = ("prefetch", "speculative", "predictors", "streaming")


def config_of(policy, tokens, **kw) -> EngineConfig:
  """The one `EngineConfig` that the engine and the emulator run over `tokens`: prefetch,
  speculative, predictors and streaming become its `Prefetch`."""
  pf = {k: kw.pop(k) for k in PREFETCH_KW if k in kw}
  if pf:
    kw["prefetch"] = Prefetch(pf.get("prefetch", "none"), pf.get("speculative", "off"),
                              pf.get("predictors"), pf.get("streaming", False))
  return EngineConfig.make(policy, max_len=len(tokens) + 1, **kw)


def engine_run(cfg, params, store, policy, tokens, **kw):
  """Engine teacher-forced on `tokens` (first one as the prompt): logits, records and the
  final resident sets (`config_of`)."""
  with OffloadEngine(cfg, params, store, config_of(policy, tokens, **kw)) as eng:
    out = [eng.prefill(tokens[:1])] + [eng.decode_step(t) for t in tokens[1:]]
    final = eng.resident_sets()
  return np.stack(out), eng.records, final


def emulator_run(cfg, params, store, policy, tokens, **kw):
  em = E.make(cfg, params, store, config_of(policy, tokens, **kw), detail=True)
  t = len(tokens)
  out = E.run_streams(em, np.asarray([tokens]), np.arange(t), np.asarray([tokens[1:] + [0]]))
  logits = np.concatenate([out["first_logits"], out["logits"][0]])
  return logits, out


def assert_same_decisions(cfg, records, out):
  """Per decoded token and MoE layer: ids, actions, substitutes, fetches, admissions
  requested and inserted, evictions; and the per-token counts."""
  valid = lambda a: sorted(int(e) for e in a if e >= 0)
  for t, rec in enumerate(records):
    for j, l in enumerate(cfg.moe_layers):
      lr = rec.layers[l]
      where = f"token {t + 1}, layer {l}"
      assert list(lr.ids) == out["ids"][0, t, j].tolist(), where
      assert list(lr.actions) == out["action"][0, t, j].tolist(), where
      assert list(lr.substitutes) == out["sub_ids"][0, t, j].tolist(), where
      assert list(lr.fetched) == [int(e) for e in out["fetched"][0, t, j] if e >= 0], where
      assert sorted(lr.admissions) == valid(out["admissions"][0, t, j]), where
      assert sorted(lr.admitted) == valid(out["admitted"][0, t, j]), where
      assert sorted(lr.evicted) == valid(out["evicted"][0, t, j]), where
    for i, k in enumerate(E.STATS[:-1]):
      np.testing.assert_allclose(out["stats"][0, t, i], rec[k], atol=1e-4, err_msg=k)


@pytest.fixture(scope="module")
def demo():
  if not os.path.exists(os.path.join(DEMO, "config.json")):
    pytest.skip("no demo checkpoint")
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  from moejax.io.tokenizer import Tokenizer
  text = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total"
  toks = Tokenizer(DEMO).encode(text)[:24]
  return cfg, params, store, toks


@pytest.mark.parametrize("name", list(POLICIES))
def test_agrees_with_engine_on_demo_model(demo, name):
  cfg, params, store, toks = demo
  policy = POLICIES[name]
  ref, records, final = engine_run(cfg, params, store, policy, toks)
  logits, out = emulator_run(cfg, params, store, policy, toks)
  np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=2e-6)   # float32 rounding
  assert_same_decisions(cfg, records, out)
  assert final == {l: sorted(int(e) for e in out["slot_expert"][0, -1, j] if e >= 0)
                   for j, l in enumerate(cfg.moe_layers)}
  st = out["stats"][0].sum(0)
  if name in ("quality", "threshold", "speed", "first_choice", "substitute_all", "least_stale"):
    assert st[E.STATS.index("substituted")] > 0          # the policy really substituted
  if name in ("quality", "speed", "drop", "least_stale"):
    assert st[E.STATS.index("admitted")] > 0             # and admitted in the background
  if name == "drop":
    assert st[E.STATS.index("dropped")] > 0 and st[E.STATS.index("substituted")] == 0
  if name == "host":
    assert st[E.STATS.index("host_calls")] > 0
  if name in ("fetch_low", "threshold_low", "cost"):
    assert st[E.STATS.index("fetches_low")] > 0           # low-precision copies were computed
    assert not np.allclose(logits, engine_run(cfg, params, store, "baseline", toks)[0], atol=1e-4)
  if name == "threshold_low":
    assert st[E.STATS.index("fetches")] > 0 and st[E.STATS.index("substituted")] > 0
  if name == "cost":     # int4 at lam 2: some misses wait in full, some are substituted
    assert st[E.STATS.index("fetches")] > 0 and st[E.STATS.index("substituted")] > 0


# ------------------------------------------------------------------ other families
# quality with high tau and low beta: substitutes (top-2 shares are near 0.5) and admits on
# these tiny models
FAMILY_QUALITY = P.make_policy("quality", tau=0.6, admission_beta=0.05)


@pytest.mark.parametrize("family,fraction", [("qwen3_next", 0.25), ("glm4_moe", 0.25),
                                             ("qwen3_moe", 0.125)],
                         ids=["qwen3_next", "glm4_moe", "qwen3_moe-staging"])
def test_agrees_with_engine_on_models_with_several_layer_kinds(family, fraction,
                                                              tmp_path_factory):
  """Each family's tiny random model (tests/hf_models.py): qwen3_next (DeltaNet and gated
  full attention, a dense layer), glm4_moe (a dense first layer, a sigmoid group router),
  qwen3_moe with one slot per layer below top-2 (a staging slot, trimmed after every
  token): the same logits, decisions, admissions, evictions and final resident sets."""
  from tests.test_engine_programs import FAMILY_PROMPT, FAMILY_STREAM, family_model
  cfg, params, store, _ = family_model(family, tmp_path_factory)
  assert not all(cfg.sparse_layers)                  # a dense layer among the MoE layers
  toks = FAMILY_PROMPT + FAMILY_STREAM + FAMILY_PROMPT
  ref, records, final = engine_run(cfg, params, store, FAMILY_QUALITY, toks,
                                   cache_fraction=fraction)
  logits, out = emulator_run(cfg, params, store, FAMILY_QUALITY, toks, cache_fraction=fraction)
  np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=0)
  assert_same_decisions(cfg, records, out)
  assert final == {l: sorted(int(e) for e in out["slot_expert"][0, -1, j] if e >= 0)
                   for j, l in enumerate(cfg.moe_layers)}
  assert sum(r.substituted for r in records) > 0 and sum(r.admitted for r in records) > 0
  if fraction == 0.125:   # trimmed back to S = 1 after every token, admissions included
    resident = (out["slot_expert"] >= 0).sum(-1)         # [1, T, L]
    assert np.all(resident <= 1)


# ------------------------------------------------------------------ tiny random model
@pytest.fixture(scope="module")
def tiny():
  rng = np.random.default_rng(0)
  cfg, params, store = tiny_models.tiny_model(rng)
  toks = [int(t) for t in rng.integers(0, 64, 16)]
  return cfg, params, store, toks


def test_streams_reset_attention_and_fetch_all_is_exact(tiny):
  """fetch_all at 25% equals the fully resident model over each attention window;
  two streams in one vmapped call equal each run alone."""
  cfg, params, store, toks = tiny
  t = len(toks)
  pos = np.arange(t) % 8                                   # two windows of 8
  streams = np.asarray([toks, toks[::-1]], np.int32)
  targets = np.roll(streams, -1, axis=1)
  em = E.make(cfg, params, store, EngineConfig.make("fetch_all", max_len=8))
  out = E.run_streams(em, streams, pos, targets)
  model = Transformer(cfg)
  for b in range(2):
    for w in range(2):
      seg = streams[b, 8 * w:8 * w + 8]
      lg, _, _ = model.apply({"params": params}, jnp.asarray(seg[None]), store.to_device())
      nll = -np.asarray(jax.nn.log_softmax(lg[0]))[np.arange(8), targets[b, 8 * w:8 * w + 8]]
      np.testing.assert_allclose(out["nll"][b, 8 * w:8 * w + 8], nll, atol=2e-5)
  alone = E.run_streams(em, streams[1:], pos, targets[1:])
  np.testing.assert_allclose(alone["nll"][0], out["nll"][1], atol=1e-6)
  np.testing.assert_array_equal(alone["stats"][0], out["stats"][1])


def test_controls(tiny):
  cfg, params, store, toks = tiny
  t = len(toks)
  run = lambda pol, c: E.run_streams(E.make(cfg, params, store, EngineConfig.make(
      pol, max_len=t), control=c),
                                     np.asarray([toks]), np.arange(t), np.asarray([toks]))
  base = run("fetch_all", None)
  # substituting no miss is fetch_all; substituting every miss is substitute_all
  none = run("substitute_all", E.Control("random", prob=0.0))
  np.testing.assert_allclose(none["nll"], base["nll"], atol=1e-6)
  allm = run("substitute_all", E.Control("random", prob=1.0))
  ref = run("substitute_all", None)
  np.testing.assert_allclose(allm["nll"], ref["nll"], atol=1e-6)
  np.testing.assert_array_equal(allm["stats"], ref["stats"])
  # band [0, 1) protecting the first choice is first_choice; [tau, 1) leaves light misses
  band = run("substitute_all", E.Control("band", lo=0.0, hi=1.0, protect_first=True))
  np.testing.assert_array_equal(band["stats"], run("first_choice", None)["stats"])
  i = E.STATS.index("first_substituted")
  assert band["stats"][..., i].sum() == 0 and allm["stats"][..., i].sum() > 0


def test_bad_input_names_the_flag(tiny):
  cfg, params, store, toks = tiny
  with pytest.raises(P.PolicyError, match="--policy"):
    E.make(cfg, params, store, EngineConfig.make("nonsense"))
  with pytest.raises(ValueError, match="--cache_fraction"):
    E.make(cfg, params, store, EngineConfig.make("quality", cache_fraction=1.5))
  with pytest.raises(E.EmulatorError, match="EngineConfig.make"):
    E.make(cfg, params, store, "quality")       # a policy name alone: the config builds it
  with pytest.raises(E.EmulatorError, match="--expert_devices"):
    E.make(cfg, params, store, EngineConfig.make("quality", expert_devices=2))
  em = E.make(cfg, params, store, EngineConfig.make("quality", max_len=8))
  with pytest.raises(E.EmulatorError, match="non-empty"):
    E.run_streams(em, np.zeros((1, 0), np.int32), np.zeros(0), np.zeros((1, 0)))
  with pytest.raises(E.EmulatorError, match="--max_len"):
    E.run_streams(em, np.zeros((1, 9), np.int32), np.arange(9), np.zeros((1, 9)))
