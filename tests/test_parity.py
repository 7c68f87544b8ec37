"""Parity with transformers on tiny random models, both expert layouts, f32."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.loader import load_model
from moejax.model import Transformer
from moejax.sampler import Sampler, SamplingParams
from tests import hf_models

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request, tmp_path_factory):
  fam = request.param
  model = hf_models.build(fam)
  tokens = [int(t) for t in np.random.default_rng(1).integers(0, 96, 12)]
  pre, dec, gen = hf_models.reference(model, tokens, 32)
  dirs = {lay: hf_models.save(model, str(tmp_path_factory.mktemp(f"{fam}_{lay}")), lay)
          for lay in ("per_expert", "fused")}
  return dict(family=fam, tokens=tokens, pre=pre, dec=dec, gen=gen, dirs=dirs)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_prefill_logits_match(reference, layout):
  cfg, params, store = load_model(reference["dirs"][layout])
  assert cfg.model_type == reference["family"]
  logits, _, router = Transformer(cfg).apply({"params": params},
                                             jnp.array([reference["tokens"]]), store.to_device())
  chex.assert_shape(logits, (1, len(reference["tokens"]), cfg.vocab_size))
  chex.assert_type(logits, jnp.float32)
  np.testing.assert_allclose(np.asarray(logits[0]), reference["pre"], atol=1e-4, rtol=0)
  assert len(router) == cfg.num_layers


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_cached_decode_and_greedy_generation_match(reference, layout):
  cfg, params, store = load_model(reference["dirs"][layout])
  s = Sampler(cfg, params, store.to_device(), max_len=64)
  toks, gen = reference["tokens"], reference["gen"]
  _, cache = s.prefill(np.array([toks]))
  for i in range(32):
    _, lg, cache = s.decode_step(cache, jnp.array([gen[i]]), len(toks) + i, SamplingParams(),
                                 jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(lg[0]), reference["dec"][i], atol=1e-4, rtol=0)
  out = s.generate(toks, SamplingParams(max_new_tokens=32))
  assert out == gen


def test_bf16_runs_close_to_f32(reference):
  cfg, params, store = load_model(reference["dirs"]["fused"], dtype=jnp.bfloat16)
  chex.assert_type(jax.tree_util.tree_leaves(params), jnp.bfloat16)
  logits, _, _ = Transformer(cfg, jnp.bfloat16).apply(
      {"params": params}, jnp.array([reference["tokens"]]), store.to_device())
  chex.assert_type(logits, jnp.float32)
  assert np.abs(np.asarray(logits[0]) - reference["pre"]).max() < 0.1
