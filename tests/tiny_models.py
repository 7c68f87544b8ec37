"""The engine tests' tiny random qwen3_moe model, built in moejax (no transformers):
8 experts top-2 of width 16 over a hidden size of 32, on a vocabulary of 64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.io.loader import expert_shapes
from moejax.io.store import ExpertStore
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer


def tiny_config(sparse_layers=(True, True)) -> ModelConfig:
  """One layer per entry of `sparse_layers` (True: routed experts; False: a dense MLP)."""
  return ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32,
                     num_layers=len(sparse_layers), num_heads=4, num_kv_heads=2, head_dim=8,
                     num_experts=8, top_k=2, moe_intermediate_size=16, intermediate_size=48,
                     sparse_layers=tuple(sparse_layers), qk_norm="head",
                     norm_topk_prob=True).validate()


def random_store(cfg: ModelConfig, rng: np.random.Generator, scale: float) -> ExpertStore:
  """Each sparse layer's experts drawn from `rng` (standard normal times `scale`, f32)."""
  return ExpertStore.from_stacked([
      None if not s else {k: (rng.standard_normal((cfg.num_experts,) + shp) * scale
                              ).astype(np.float32) for k, shp in expert_shapes(cfg).items()}
      for s in cfg.sparse_layers])


def tiny_model(rng: np.random.Generator, scale: float = 0.3):
  """(cfg, params, store) of two MoE layers: the experts from `rng`, the parameters
  initialised (jitted) from PRNGKey(1)."""
  cfg = tiny_config()
  store = random_store(cfg, rng, scale)
  params = jax.jit(lambda k: Transformer(cfg).init(k, jnp.zeros((1, 4), jnp.int32),
                                                   store.to_device())["params"])(
      jax.random.PRNGKey(1))
  return cfg, params, store
