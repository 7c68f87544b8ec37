"""Rows decoded together under an offload policy (issue 47 item 1): `OffloadEngine.batched`
and the emulator's shared-cache batch (`emulator.make(batch=B)`).

Exactness: with fetch_all, and with every expert resident, each row's greedy tokens and
logits are those it gets decoded alone; a batch of one is the engine's own decode, record
for record; the engine's batch equals the emulator's (decisions and counts equal, logits
within float rounding); the emulator's batch of one is its plain streams.  The budget
holds between steps and every resident expert's slot holds its weights."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cache import policy as P
from moejax.cache import step as step_lib
from moejax.io.loader import expert_shapes
from moejax.io.store import ExpertStore
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.prefetch.steps import Prefetch
from moejax.research import emulator as E
from moejax.research import shared_batch

PROMPTS = ([3, 17, 5, 60, 22], [9, 1, 44], [7, 7, 8, 2, 30, 31, 50])
ADMITTING = P.make_policy("quality", tau=0.6, admission_beta=0.2)
MAX_LEN = 32


def _model(sparse):
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=16, intermediate_size=48, sparse_layers=sparse,
                    qk_norm="head", norm_topk_prob=True).validate()
  rng = np.random.default_rng(0)
  exps = [None if not s else {k: (rng.standard_normal((8,) + shp) * 0.2).astype(np.float32)
                              for k, shp in expert_shapes(cfg).items()} for s in sparse]
  store = ExpertStore.from_stacked(exps)
  params = jax.jit(lambda k: Transformer(cfg).init(k, jnp.zeros((1, 4), jnp.int32),
                                                   store.to_device())["params"])(
      jax.random.PRNGKey(0))
  return cfg, params, store


@pytest.fixture(scope="module")
def uniform():        # every layer MoE: the engine scans its layers
  return _model((True, True, True))


@pytest.fixture(scope="module")
def mixed():          # a dense layer between: the engine unrolls its layers
  return _model((True, False, True))


def engine(model, policy, fraction=0.25):
  cfg, params, store = model
  return OffloadEngine(cfg, params, store, EngineConfig.make(policy, max_len=MAX_LEN,
                                                             cache_fraction=fraction))


def alone(model, policy, steps=5, fraction=0.25):
  """Each prompt decoded greedily on its own engine -> [(tokens, logits [steps + 1, V])]."""
  out = []
  for p in PROMPTS:
    with engine(model, policy, fraction) as eng:
      lg = [eng.prefill(p)]
      for _ in range(steps):
        lg.append(eng.decode_step(int(np.argmax(lg[-1]))))
      out.append(([int(np.argmax(x)) for x in lg], np.stack(lg)))
  return out


def together(model, policy, steps=5, fraction=0.25, rows=4, check=None):
  """The prompts joining a batch of `rows` (the last row free) -> (per prompt (tokens,
  logits), the records)."""
  with engine(model, policy, fraction) as eng:
    b = eng.batched(rows)
    lg = {r: [b.prompt(p, r)] for r, p in enumerate(PROMPTS)}
    valid = np.arange(rows) < len(PROMPTS)
    for _ in range(steps):
      toks = np.array([int(np.argmax(lg[r][-1])) if r in lg else 0 for r in range(rows)])
      out = b.step(toks, valid)
      for r in lg:
        lg[r].append(out[r])
      if check:
        check(eng, b)
    recs = b.take_records()
  return [([int(np.argmax(x)) for x in lg[r]], np.stack(lg[r])) for r in lg], recs


def check_budget(eng, b):
  """Within S between steps; each resident expert's slot holds its weights, except the
  admissions the last step requested (copied at the next step)."""
  pending = {l: set() for l in eng.moe_layers}
  for r in b.records[-int(np.sum(b.pos > 0)):]:
    for l, lr in r.layers.items():
      pending[l] |= set(lr.admissions)
  sets = b.resident_sets()
  from moejax.offload import decode
  for l, st in decode.per_layer(eng.program, eng.moe_layers, b.states).items():
    se = np.asarray(st.slot_expert)
    assert (se >= 0).sum() <= eng.budget.slots
    assert pending[l] <= set(sets[l])
    for s, e in enumerate(se):
      if e >= 0 and e not in pending[l]:
        np.testing.assert_array_equal(np.asarray(st.buffers["down"][s]),
                                      eng.store.get(l, int(e))["down"])


@pytest.mark.parametrize("which", ["uniform", "mixed"])
@pytest.mark.parametrize("policy,fraction", [("baseline", 0.25), ("baseline", 1.0)])
def test_fetch_all_rows_equal_each_decoded_alone(request, which, policy, fraction):
  model = request.getfixturevalue(which)
  ref = alone(model, policy, fraction=fraction)
  got, recs = together(model, policy, fraction=fraction, check=check_budget)
  for (t_a, l_a), (t_b, l_b) in zip(ref, got):
    assert t_a == t_b
    np.testing.assert_allclose(l_b, l_a, atol=2e-5, rtol=0)
  assert len(recs) == 5 * len(PROMPTS)              # one record per active row and step
  assert all(r.rows == len(PROMPTS) for r in recs)  # the step's active rows
  if fraction < 1:
    assert sum(r.fetches for r in recs) > 0        # the batch really missed


def test_a_batch_of_one_is_the_engines_own_decode(uniform):
  with engine(uniform, ADMITTING) as eng:
    lg = [eng.prefill(PROMPTS[0])]
    for _ in range(8):
      lg.append(eng.decode_step(int(np.argmax(lg[-1]))))
    ref = eng.records
  with engine(uniform, ADMITTING) as eng:
    b = eng.batched(1)
    got = [b.prompt(PROMPTS[0], 0)]
    for _ in range(8):
      got.append(b.step(np.array([int(np.argmax(got[-1]))]), np.array([True]))[0])
    recs = b.take_records()
  np.testing.assert_array_equal(np.stack(got), np.stack(lg))
  assert sum(r.admissions for r in recs) > 0       # the policy admitted
  for a, c in zip(ref, recs):
    assert a.layers == c.layers
    assert (a.hits, a.fetches, a.substituted, a.admissions) == (c.hits, c.fetches,
                                                                c.substituted, c.admissions)


@pytest.mark.parametrize("which", ["uniform", "mixed"])
def test_engine_batch_equals_emulator_batch(request, which):
  """Teacher-forced streams, each a one-token prompt then a token a step, 3 rows sharing
  the cache: the same decisions and counts in the engine and the emulator."""
  cfg, params, store = model = request.getfixturevalue(which)
  rng = np.random.default_rng(1)
  b, t = 3, 10
  toks = rng.integers(0, 64, (b, t)).astype(np.int32)
  tgts = np.roll(toks, -1, axis=1)
  em = E.make(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                    max_len=MAX_LEN), batch=b)
  out = E.run_streams(em, toks, np.arange(t, dtype=np.int32), tgts)
  chex.assert_shape(out["stats"], (b, t - 1, len(step_lib.STATS)))
  with engine(model, ADMITTING) as eng:
    bt = eng.batched(b)
    nll = [[float(-jax.nn.log_softmax(bt.prompt([int(toks[r, 0])], r))[tgts[r, 0]])
            for r in range(b)]]
    for i in range(1, t):
      lg = bt.step(toks[:, i], np.ones(b, bool))
      nll.append([float(-jax.nn.log_softmax(lg[r])[tgts[r, i]]) for r in range(b)])
    recs = bt.take_records()
  np.testing.assert_allclose(np.array(nll).T, out["nll"], atol=1e-5, rtol=0)
  keys = [k for k in step_lib.STATS if k != "first_substituted"]
  eng_stats = np.array([[[getattr(recs[i * b + r], k) for k in keys] for i in range(t - 1)]
                        for r in range(b)])
  em_stats = out["stats"][..., [step_lib.STATS.index(k) for k in keys]]
  np.testing.assert_allclose(eng_stats, em_stats, atol=1e-4, rtol=0)
  tot = em_stats.sum(axis=(0, 1))
  assert tot[keys.index("substituted")] > 0 and tot[keys.index("admissions")] > 0


def test_emulator_batch_of_one_is_its_plain_streams(uniform):
  cfg, params, store = uniform
  rng = np.random.default_rng(2)
  toks = rng.integers(0, 64, (2, 9)).astype(np.int32)
  tgts, pos = np.roll(toks, -1, axis=1), np.arange(9, dtype=np.int32)
  em = E.make(cfg, params, store, EngineConfig.make(ADMITTING, cache_fraction=0.25,
                                                    max_len=MAX_LEN))
  plain = E.run_streams(em, toks, pos, tgts)
  shared = shared_batch.run_streams(em, toks, pos, tgts, 0, 0, None)
  np.testing.assert_array_equal(shared["nll"], plain["nll"])
  np.testing.assert_array_equal(shared["stats"], plain["stats"])


def test_batch_errors(uniform):
  cfg, params, store = uniform
  with engine(uniform, "quality") as eng:
    with pytest.raises(ValueError, match="--max_batch"):
      eng.batched(0)
    b = eng.batched(2)
    with pytest.raises(RuntimeError, match="batch"):
      eng.prefill([1, 2])
    with pytest.raises(ValueError, match="2 tokens and flags"):
      b.step(np.zeros(3, np.int32), np.ones(3, bool))
  with pytest.raises(E.EmulatorError, match="--batch"):
    E.make(cfg, params, store, EngineConfig.make("quality", prefetch=Prefetch("reuse")),
           batch=2)
  em = E.make(cfg, params, store, EngineConfig.make("quality", max_len=MAX_LEN), batch=2)
  with pytest.raises(E.EmulatorError, match="multiple of --batch"):
    E.run_streams(em, np.zeros((3, 4), np.int32), np.arange(4), np.zeros((3, 4), np.int32))


def test_an_emulated_link_waits_once_a_step_for_its_fetches(uniform):
  """Each step waits out the link's time of the union of its rows' fetches (each expert
  once); every row of the step reports that wait; the prompts' copies are charged too."""
  from moejax.offload import link as link_lib
  cfg, params, store = uniform
  link = link_lib.parse_link("1MB/s,100us")
  per = link.transfer_time(store.expert_nbytes()) - link.latency_s
  with OffloadEngine(cfg, params, store, EngineConfig.make(
      "baseline", max_len=MAX_LEN, cache_fraction=0.25, link=link)) as eng:
    b = eng.batched(3)
    lg = [b.prompt(p, r) for r, p in enumerate(PROMPTS)]
    for _ in range(3):
      lg = b.step(np.argmax(np.stack(lg), -1), np.ones(3, bool))
    recs = b.records
  steps = [recs[i:i + 3] for i in range(0, len(recs), 3)]
  assert sum(r.fetches for r in recs) > 0
  for rows in steps:
    assert len({r.wait_s for r in rows}) == 1          # the step's wait, as each row saw it
    fetched = [sorted({e for r in rows for e in r.layers[l].fetched}) for l in eng.moe_layers]
    want = sum(len(f) * per + (link.latency_s if f else 0.0) for f in fetched)
    assert rows[0].wait_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert rows[0].wall_s >= rows[0].wait_s
