"""Sampling rules, generation on a random model, and the device loop on the demo model."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model import sampler as sampler_lib
from moejax.model.config import ModelConfig
from moejax.io.loader import init_random, load_model
from moejax.model.sampler import Sampler, SamplingParams, sample_token
from moejax.io.store import ExpertStore
from moejax.io.tokenizer import Tokenizer

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")
needs_demo = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "config.json")),
                                reason="ckpts/demo not present")


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
  assert s.generate_loop([1, 2, 3], sp, seed=7) == a
  assert s.generate_loop([1, 2, 3], SamplingParams(1.0, 1.0, 20, (stop,)), seed=7) == c
  with pytest.raises(ValueError, match="max_len"):
    s.generate(list(range(60)), sp)
  with pytest.raises(ValueError, match="max_len"):
    s.generate_loop(list(range(60)), sp)
  # the jitted steps take params and experts as arguments: a dropped Sampler's device
  # experts are freed (a method jitted with `self` static would keep them alive)
  import gc
  import weakref
  ref = weakref.ref(s.experts[0]["down"])
  del s
  gc.collect()
  assert ref() is None


@pytest.fixture(scope="module")
def demo():
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  s = Sampler(cfg, params, store.to_device(), max_len=128)
  return s, Tokenizer(DEMO).encode("def binary_search(items, target):\n")


def _mid_stop(ids: list[int]) -> int:
  """A token of `ids` first produced well inside the run (a stop there ends it mid-way)."""
  return next(t for k, t in enumerate(ids) if k >= 3 and ids.index(t) == k)


@needs_demo
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.8, 0.9), (1.0, 1.0)])
def test_loop_matches_per_token_generate(demo, temperature, top_p):
  s, prompt = demo
  sp = SamplingParams(temperature, top_p, 24)
  ref = s.generate(prompt, sp, seed=3)
  assert len(ref) == 24 and s.generate_loop(prompt, sp, seed=3) == ref
  if temperature:     # another seed, other tokens, still the same in both paths
    other = s.generate(prompt, sp, seed=4)
    assert other != ref and s.generate_loop(prompt, sp, seed=4) == other
  stop = _mid_stop(ref)
  # the stop id is kept, as the per-token path does; a padded stop list (2 ids -> 4)
  sp_stop = SamplingParams(temperature, top_p, 24, (123456, stop))
  cut = s.generate(prompt, sp_stop, seed=3)
  assert cut == ref[:ref.index(stop) + 1] and 3 < len(cut) < 24
  assert s.generate_loop(prompt, sp_stop, seed=3) == cut
  for n in (1, 0):    # the first token only (sampled from the prefill), and none
    sp_n = SamplingParams(temperature, top_p, n)
    assert s.generate_loop(prompt, sp_n, seed=3) == s.generate(prompt, sp_n, seed=3) == ref[:n]


@needs_demo
def test_loop_compiles_once_per_bucket(demo, monkeypatch):
  """Prompts of one prefill bucket, token counts of one bucket, other temperatures, top_p,
  seeds and stop ids, and a new Sampler: one trace of the loop."""
  s, prompt = demo
  counted = jax.jit(chex.assert_max_traces(sampler_lib.decode_loop.__wrapped__, n=1),
                    static_argnames=("model", "bucket_new", "greedy", "nucleus"),
                    donate_argnames=("cache",))
  monkeypatch.setattr(sampler_lib, "decode_loop", counted)
  ref = s.generate(prompt, SamplingParams(0.7, 0.9, 12), seed=1)
  assert s.generate_loop(prompt, SamplingParams(0.7, 0.9, 12), seed=1) == ref
  s2 = Sampler(s.cfg, s.params, s.experts, max_len=s.max_len)
  other = prompt[:-3] + [5, 6]                   # same prefill bucket, other tokens
  assert sampler_lib.bucket(len(other)) == sampler_lib.bucket(len(prompt))
  out = s2.generate_loop(other, SamplingParams(0.9, 0.5, 15, (7,)), seed=2)
  assert out == s2.generate(other, SamplingParams(0.9, 0.5, 15, (7,)), seed=2)
  with pytest.raises(AssertionError, match="traced > 1"):   # a new bucket would retrace
    s.generate_loop(prompt, SamplingParams(0.7, 0.9, 40), seed=1)


def test_a_prompts_padding_goes_to_no_expert():
  """`Transformer.hidden(valid_BxT=...)`: a bucket's padding positions route to no expert
  (the kernels skip their pairs), and the prompt's own positions keep their bits."""
  from moejax.model.model import Transformer
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=50, hidden_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=8, intermediate_size=64,
                    sparse_layers=(True, True), qk_norm="head").validate()
  params, exps = init_random(cfg, seed=1, scale=0.5)
  experts = ExpertStore.from_stacked(exps).to_device()
  model = Transformer(cfg, jnp.float32)
  toks = jnp.asarray(np.random.default_rng(0).integers(1, 50, (1, 16)), jnp.int32)
  hidden = lambda **kw: model.apply({"params": params}, toks, experts, method=Transformer.hidden,
                                    **kw)[0]
  x_all = np.asarray(hidden())
  x_pad = np.asarray(hidden(valid_BxT=jnp.arange(16)[None] < 9))
  np.testing.assert_array_equal(x_pad[:, :9], x_all[:, :9])
  assert np.all(np.abs(x_pad[:, 9:] - x_all[:, 9:]).max(axis=-1) > 1e-3)
  # the Sampler's prompt pass pads 9 tokens to 16 with this mask: the last logits of the
  # unpadded forward (another program: to float32 rounding)
  s = Sampler(cfg, params, experts, max_len=32)
  logits, _ = s.prefill(np.asarray(toks[:, :9]))
  ref = model.apply({"params": params}, toks[:, :9], experts)[0][:, -1]
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=1e-5, atol=1e-6)
