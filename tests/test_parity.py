"""Parity with transformers on tiny random models, both expert layouts, f32."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io.loader import load_model
from moejax.model.model import Transformer
from tests import hf_models

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]


reference = hf_models.reference_fixture(FAMILIES)


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
  hf_models.assert_cached_decode_and_greedy_match(cfg, params, store, reference)


def test_bf16_runs_close_to_f32(reference):
  cfg, params, store = load_model(reference["dirs"]["fused"], dtype=jnp.bfloat16)
  chex.assert_type(jax.tree_util.tree_leaves(params), jnp.bfloat16)
  logits, _, _ = Transformer(cfg, jnp.bfloat16).apply(
      {"params": params}, jnp.array([reference["tokens"]]), store.to_device())
  chex.assert_type(logits, jnp.float32)
  assert np.abs(np.asarray(logits[0]) - reference["pre"]).max() < 0.1
