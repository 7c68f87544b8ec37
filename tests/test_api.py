"""The Python API's figures are moejax-generate's: per call, the compile excluded.

The bug: the README's example printed 140.88 ms a token where moejax-generate printed
1.95 ms; `engine.stats()` timed the first decode step's compile, and a second and third
call averaged over every call so far (141.85, 71.68, 48.36 ms)."""

import os

import pytest

import moejax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
  return moejax.load(os.path.join(REPO, "ckpts", "demo"))


def spied(engine, events: list):
  """Records the order of the engine's compiles (`warmup`) and decode steps."""
  warmup, step = engine.warmup, engine.decode_step
  engine.warmup = lambda *a, **k: (events.append("compile"), warmup(*a, **k))[1]
  engine.decode_step = lambda *a, **k: (events.append("step"), step(*a, **k))[1]


def test_stats_are_per_call_and_the_compile_comes_before_the_first_timed_step(model):
  events: list = []
  with moejax.OffloadEngine.from_model(model, "quality", link="16GB/s,10us") as engine:
    spied(engine, events)
    per_call = []
    for policy in ("quality", "quality", "speed"):
      engine.set_policy(policy)
      start = len(events)
      moejax.generate(engine, "def fibonacci(n):", max_new_tokens=5)
      mine = events[start:]
      steps = mine.count("step")
      assert steps >= 1
      s = engine.stats()
      per_call.append((mine, s["tokens"]))
      assert s["tokens"] == steps == len(engine.records)    # this call's steps alone
      assert s["tpot_ms"] > 0
  (first, _), (second, _), (third, _) = per_call
  assert first[0] == "compile" and "compile" not in first[1:]   # compiled, then timed
  assert "compile" not in second                  # the same program: compiled once
  assert third[0] == "compile" and "compile" not in third[1:]   # a new policy's program


def test_a_model_decodes_without_an_engine(model):
  assert isinstance(moejax.generate(model, "def f(x):", max_new_tokens=3), str)


def test_one_engine_class_and_generate_runs_an_engine_built_either_way(model):
  from moejax.offload.config import EngineConfig
  from moejax.offload.engine import OffloadEngine
  assert moejax.OffloadEngine is OffloadEngine
  prompt = "def fibonacci(n):"
  with moejax.OffloadEngine.from_model(model, "quality", link="native") as engine:
    assert engine.model is model
    from_model = moejax.generate(engine, prompt, max_new_tokens=4)
  config = EngineConfig.make("quality", max_len=min(512, model.cfg.max_position_embeddings),
                             dtype=model.dtype)      # from_model's defaults, native link
  with OffloadEngine(model.cfg, model.params, model.store, config) as engine:
    with pytest.raises(ValueError, match="tokenizer="):
      moejax.generate(engine, prompt, max_new_tokens=4)    # no Model: no tokenizer
    direct = moejax.generate(engine, prompt, max_new_tokens=4, tokenizer=model.tokenizer)
    assert engine.stats()["tokens"] >= 1
  assert direct == from_model and direct      # one class, one decode: the same greedy text
  with pytest.raises(TypeError, match="moejax.Model or a moejax.OffloadEngine"):
    moejax.generate("ckpts/demo", prompt)
