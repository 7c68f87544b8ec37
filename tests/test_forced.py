"""Teacher-forced generation (`SamplingParams.forced_ids`): every engine decodes a given
token stream through its own generate path, so benchmarks compare engines on the same
tokens and the same experts (benchmarks/stream.py)."""

import os

import numpy as np
import pytest

from moejax.io.loader import load_model
from moejax.model.sampler import Sampler, SamplingParams
from moejax.offload.engine import EngineConfig, OffloadEngine

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")
PROMPT = [17, 250, 31, 999, 12, 4000, 77, 5]
STREAM = [int(t) for t in np.random.default_rng(7).integers(1, 8000, 12)]


@pytest.fixture(scope="module")
def demo():
  if not os.path.exists(os.path.join(DEMO, "config.json")):
    pytest.skip("no demo model at ckpts/demo")
  return load_model(DEMO)


def test_forced_ids_must_be_token_ids():
  with pytest.raises(ValueError, match="forced_ids"):
    SamplingParams(forced_ids=(3, -1))
  np.testing.assert_array_equal(SamplingParams(forced_ids=(4, 5)).forced(4), [4, 5, -1, -1])


def test_the_sampler_returns_the_forced_stream_then_samples_on(demo):
  cfg, params, store = demo
  s = Sampler(cfg, params, store.to_device(np.float32), max_len=64)
  sp = SamplingParams(max_new_tokens=len(STREAM) + 3, forced_ids=tuple(STREAM))
  stepped, looped = s.generate(PROMPT, sp), s.generate_loop(PROMPT, sp)
  assert stepped[:len(STREAM)] == looped[:len(STREAM)] == STREAM
  # after the forced part: greedy from the forced context, the same on both paths
  assert stepped == looped
  greedy = s.generate(PROMPT + STREAM, SamplingParams(max_new_tokens=3))
  assert stepped[len(STREAM):] == greedy


def test_the_engines_device_loop_and_token_path_see_the_same_stream(demo):
  """The engine's generate on the device loop and token by token (on_token) decode the
  forced stream with the same cache decisions, token for token."""
  cfg, params, store = demo
  sp = SamplingParams(max_new_tokens=len(STREAM), forced_ids=tuple(STREAM))
  keys = ("hits", "fetches", "substituted", "evictions")
  counts = []
  for per_token in (None, lambda t: None):
    with OffloadEngine(cfg, params, store, EngineConfig.make("quality", cache_fraction=0.25,
                                                             link="native", max_len=64)) as eng:
      assert eng.generate(PROMPT, sp, on_token=per_token) == STREAM
      counts.append([[r[k] for k in keys] for r in eng.records])
  assert len(counts[0]) == len(STREAM) - 1      # the first token comes from the prompt pass
  assert counts[0] == counts[1]
  assert sum(c[1] for c in counts[0]) > 0       # misses were fetched: a real test of the cache
