"""A policy's first request on the server is timed like the later ones: its programs
compile before the request's clock starts, and the compile time is reported apart.

The bug: the first request under a new policy reported tpot_ms of 256-394 ms against
2-7 ms for later ones (the decode step compiled inside the first timed token)."""

import os
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")
PROMPT = "def fibonacci(n):"
N = 12


@pytest.fixture(scope="module")
def worker():
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.io.tokenizer import Tokenizer
  from moejax.offload.engine import EngineConfig, OffloadEngine
  from moejax.serve import metrics
  from moejax.serve.worker import Loaded, Worker

  def load():
    cfg, params, store = load_model(DEMO, dtype=jnp.float32)
    eng = OffloadEngine(cfg, params, store, EngineConfig.make("quality", cache_fraction=0.25,
                                                              link="native", max_len=64))
    eng.warmup(prompt_lengths=(16,))         # as the server's start-up
    return Loaded(eng, Tokenizer(DEMO), cfg, None)

  w = Worker(load, metrics.Metrics())
  w.start()
  assert w.ready.wait(600), w.failed
  yield w
  w.stop()
  w.loaded.engine.close()


def request(worker, policy_name):
  """One greedy request through the worker -> its usage.moejax."""
  from moejax.cache.policy import make_policy
  from moejax.model.sampler import SamplingParams
  from moejax.serve.worker import Job
  done, got = threading.Event(), {}

  def sink(kind, value):
    if kind != "text":
      got[kind] = value
      done.set()
  ids = worker.loaded.tok.encode(PROMPT)
  worker.submit(Job(ids, SamplingParams(0.0, 1.0, N, ()), 0, make_policy(policy_name), [],
                    600.0, sink))
  assert done.wait(600)
  assert "done" in got, got
  return got["done"].offload


def test_a_policys_first_request_is_timed_like_the_later_ones(worker):
  first = request(worker, "baseline")        # a policy the start-up did not compile
  later = [request(worker, "baseline") for _ in range(2)]
  assert first["compile_ms"] > 0 and all(r["compile_ms"] == 0 for r in later)
  best = min(r["tpot_ms"] for r in later)
  # the compile in the first token made it 50-500x (2042 ms against 3.8 on a busy 2-core
  # VM); what is left is jit re-tracing the step on its first call (~5 ms a token here)
  assert first["tpot_ms"] < 10 * best + 20, (first, later)
  assert first["compile_ms"] > 10 * first["tpot_ms"], first
  text = worker.metrics.render()
  assert "moejax_policy_compiles_total 1\n" in text, text


def test_the_start_up_policy_does_not_compile_again(worker):
  assert request(worker, "quality")["compile_ms"] == 0
