"""Sampling rules and generation on a random model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.loader import init_random
from moejax.sampler import Sampler, SamplingParams, sample_token
from moejax.store import ExpertStore


def test_greedy_and_top_p():
  logits = jnp.array([[0.0, 3.0, 1.0, 2.9]])
  assert int(sample_token(logits, jax.random.PRNGKey(0), 0.0, 1.0)[0]) == 1
  # top_p small: only the most likely token survives, whatever the key
  picks = {int(sample_token(logits, jax.random.PRNGKey(i), 1.0, 0.01)[0]) for i in range(20)}
  assert picks == {1}
  # top_p 0.6: tokens 1 and 3 (masses ~.46, ~.42) survive, never 0 or 2
  picks = {int(sample_token(logits, jax.random.PRNGKey(i), 1.0, 0.6)[0]) for i in range(60)}
  assert picks == {1, 3}


@pytest.mark.parametrize("kw, flag", [(dict(temperature=-1), "--temperature"),
                                      (dict(top_p=0.0), "--top_p"),
                                      (dict(max_new_tokens=-2), "--max_new_tokens")])
def test_bad_sampling_params_name_the_flag(kw, flag):
  with pytest.raises(ValueError, match=flag):
    SamplingParams(**kw)


def test_generation_stops_and_is_reproducible():
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=50, hidden_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=8, intermediate_size=64,
                    sparse_layers=(True, True), qk_norm="head").validate()
  params, exps = init_random(cfg, seed=1, scale=0.5)
  s = Sampler(cfg, params, ExpertStore.from_stacked(exps).to_device(), max_len=64)
  sp = SamplingParams(temperature=1.0, max_new_tokens=20)
  a, b = s.generate([1, 2, 3], sp, seed=7), s.generate([1, 2, 3], sp, seed=7)
  assert a == b and len(a) == 20
  stop = a[4]
  c = s.generate([1, 2, 3], SamplingParams(1.0, 1.0, 20, (stop,)), seed=7)
  assert c == a[:a.index(stop) + 1]
  with pytest.raises(ValueError, match="max_len"):
    s.generate(list(range(60)), sp)
  # the jitted steps take params and experts as arguments: a dropped Sampler's device
  # experts are freed (a method jitted with `self` static would keep them alive)
  import gc
  import weakref
  ref = weakref.ref(s.experts[0]["down"])
  del s
  gc.collect()
  assert ref() is None
