"""Study plumbing: streams layout, metrics, policy specs, greedy generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.research import emulator as E
from moejax.offload.config import EngineConfig
from moejax.model.model import Transformer
from moejax.research.study import metrics as M
from moejax.research.study import runner as R
from moejax.research.study import streams as S
from tests import tiny_models


def test_streams_layout_is_deterministic_and_scores_in_document_targets():
  docs = [("stdlib", "a", [1, 2, 3, 0]), ("humaneval", "b", [4, 5, 0]),
          ("stdlib", "c", [6, 7, 8, 9, 0])]
  st = S.build(docs, num_streams=2, max_tokens=16, window=4, seed=0)
  st2 = S.build(docs, num_streams=2, max_tokens=16, window=4, seed=0)
  np.testing.assert_array_equal(st.tokens, st2.tokens)
  t = st.tokens.shape[1]
  assert st.tokens.shape[0] == 2 and t <= 8              # T <= max_tokens / streams
  np.testing.assert_array_equal(st.pos, np.arange(t) % 4)
  for b in range(2):
    for i in range(t):
      if st.scored[b, i]:        # the target is the next token of the same document
        assert st.doc[b, i + 1] == st.doc[b, i] and st.targets[b, i] == st.tokens[b, i + 1]
  # every token of every document is in exactly one stream; each document's first
  # token is never a scored target
  assert st.real.sum() == 4 + 3 + 5
  assert st.scored.sum() == 3 + 2 + 4
  # cutting documents keeps their EOT
  cut = S.build(docs, 1, 100, 8, max_doc_tokens=3)
  assert sorted(cut.tokens[0][cut.real[0]].tolist()) == sorted([1, 2, 0, 4, 5, 0, 6, 7, 0])


def test_relative_increase_and_its_bootstrap():
  base = dict(doc_nll=np.array([10.0, 20.0]), doc_n=np.array([10.0, 10.0]))
  run = dict(doc_nll=np.array([11.0, 21.0]), doc_n=np.array([10.0, 10.0]))
  rel, lo, hi = M.relative_increase(run, base, reps=200)
  assert rel == pytest.approx(100 * (np.exp(2.0 / 20) - 1))       # +0.1 nats per token
  assert lo == pytest.approx(rel) and hi == pytest.approx(rel)     # same increase per doc
  r = M.pearson([0, 1, 2, 3], [0, 2, 4, 6.5])
  assert r["r"] > 0.99 and r["ci"][0] < r["r"] < r["ci"][1]
  assert M.pearson([1, 2], [1, 2])["r"] is None


def test_policy_specs():
  pol, ctl = R.parse_spec("threshold:0.1@drop")
  assert (pol.miss, pol.tau, pol.substitution, ctl) == ("threshold", 0.1, "drop", None)
  pol, ctl = R.parse_spec("random:0.25")
  assert pol.miss == "substitute_all" and ctl.prob == 0.25
  for bad, msg in (("nonsense", "--policies"), ("threshold:abc", "not a number"),
                   ("threshold:2", "--tau"), ("random:7", "--policies"), ("", "empty")):
    with pytest.raises(R.SpecError, match=msg):
      R.parse_spec(bad)


def test_greedy_fetch_all_is_the_resident_models_greedy_chain():
  cfg = tiny_models.tiny_config()
  store = tiny_models.random_store(cfg, np.random.default_rng(0), 0.3)
  model = Transformer(cfg)
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 4), jnp.int32),
                      store.to_device())["params"]
  prompts = [[3, 9, 27, 17, 51], [5, 11]]                   # different lengths, padded
  em = E.make(cfg, params, store, EngineConfig.make("fetch_all", max_len=12))
  toks = np.zeros((2, 5), np.int32)
  toks[0], toks[1, :2] = prompts[0], prompts[1]
  logits, carry = E.prefill(em.setup, em.params, em.layers, em.table, em.states, toks,
                            np.asarray([5, 2], np.int32))
  gen, _ = E.greedy(em.setup, em.params, em.layers, em.table, carry, logits,
                    np.asarray([5, 2], np.int32), steps=4)
  for b, p in enumerate(prompts):
    seq = list(p)
    for _ in range(4):
      lg, _, _ = model.apply({"params": params}, jnp.asarray([seq]), store.to_device())
      seq.append(int(jnp.argmax(lg[0, -1])))
    assert np.asarray(gen[b]).tolist() == seq[len(p):]


def test_emulate_cli_bad_input_names_the_flag():
  from absl import app, flags
  from absl.testing import flagsaver
  from moejax.cli import emulate as EM
  fl = flags.FLAGS
  if not fl.is_parsed():
    fl(["emulate"])
  with flagsaver.flagsaver(cache_fraction=1.5):
    with pytest.raises(app.UsageError, match="--cache_fraction"):
      EM.check_flags()
  with flagsaver.flagsaver(cache_fraction=0.0):
    with pytest.raises(app.UsageError, match="--cache_fraction"):
      EM.check_flags()
  with flagsaver.flagsaver(sets=["wikipedia"]):
    with pytest.raises(app.UsageError, match="--sets"):
      EM.check_flags()
  with pytest.raises(R.SpecError, match="--policies"):
    R.parse_spec("fastest")
  with pytest.raises(ValueError, match="--max_tokens"):    # an empty stream
    S.build([("stdlib", "a", [1, 2, 0])], num_streams=4, max_tokens=4, window=8)
  with pytest.raises(ValueError, match="empty"):
    S.build([], num_streams=1, max_tokens=64, window=8)
