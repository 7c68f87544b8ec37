"""Shared by the prefetch tests (tests/test_prefetch*.py): a tiny qwen3_moe model, random
default vectors and estimators, and an engine run.  Not a test file: the prefetch tests are
split over two files so that no single pytest process compiles all of their XLA programs
(one process compiling them all crashed inside XLA's CPU compiler on the CI machine)."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.loader import expert_shapes
from moejax.model import Transformer
from moejax.offload.engine import OffloadEngine
from moejax.store import ExpertStore

PROMPT = [3, 17, 5, 60, 22]
STREAM = [int(t) for t in np.random.default_rng(3).integers(0, 64, 10)]


def tiny_model():
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=16, intermediate_size=48,
                    sparse_layers=(True, True, True), qk_norm="head",
                    norm_topk_prob=True).validate()
  rng = np.random.default_rng(0)
  exps = [{k: (rng.standard_normal((8,) + shp) * 0.2).astype(np.float32)
           for k, shp in expert_shapes(cfg).items()} for _ in cfg.sparse_layers]
  store = ExpertStore.from_stacked(exps)
  seq = jnp.asarray([PROMPT + STREAM], jnp.int32)
  model = Transformer(cfg)
  params = jax.jit(lambda k: model.init(k, seq, store.to_device())["params"])(
      jax.random.PRNGKey(0))
  logits, _, _ = jax.jit(lambda p, e: model.apply({"params": p}, seq, e))(params,
                                                                         store.to_device())
  return cfg, params, store, np.asarray(logits[0, len(PROMPT) - 1:])


def vectors(cfg, seed=1):
  rng = np.random.default_rng(seed)
  return {"vectors": [rng.standard_normal((cfg.num_experts, cfg.hidden_size)).astype(np.float32)
                      * 0.1 for _ in cfg.moe_layers],
          "estimators": [None] * (len(cfg.moe_layers) - 1)}


def run_engine(cfg, params, store, prompt, stream, **kw):
  kw.setdefault("cache_fraction", 0.25)
  with OffloadEngine(cfg, params, store, kw.pop("policy", "baseline"), max_len=32, **kw) as eng:
    eng.warmup()
    out = [eng.prefill(prompt)] + [eng.decode_step(t) for t in stream]
    held = eng.held_bytes()
  return eng, np.stack(out), held


def with_estimators(cfg, seed=2, previous=False):
  """Default vectors and a random (non-zero) estimator on every layer pair (`previous`:
  estimators that also take the previous token's router probabilities)."""
  from estimators.model import LogitCorrection
  preds = vectors(cfg)
  est = []
  for j in range(len(cfg.moe_layers) - 1):
    mod = LogitCorrection(cfg.num_experts, 8)
    width = cfg.hidden_size + (cfg.num_experts if previous else 0)
    q, base = jnp.zeros((1, width)), jnp.zeros((1, cfg.num_experts))
    p = mod.init(jax.random.PRNGKey(seed + j), q, base)
    p = jax.tree_util.tree_map(lambda a: a + 0.3, p)
    w_out = jax.random.normal(jax.random.PRNGKey(seed + 100 + j), (8, cfg.num_experts))
    p["params"]["w_out"]["kernel"] = w_out      # a real correction: moves the ranking
    if previous:   # weigh the previous token's probabilities enough to move predictions
      k = p["params"]["w_in"]["kernel"]
      p["params"]["w_in"]["kernel"] = k.at[cfg.hidden_size:].multiply(30.0)
    est.append(p)
  return dict(preds, estimators=est, sources=["estimator"] * len(est))

