"""The engine's layers as one scan (`decode.Program.scan`, `layer_stack.scan_whole`): the
same logits, records, resident sets and sampled tokens as the unrolled program for a
uniform model, bit for bit; a program whose custom calls do not grow with depth; and the
cases that keep unrolling."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io.loader import expert_shapes
from moejax.io.store import ExpertStore, LayerExperts
from moejax.kernels import cpu_kernel
from moejax.offload import decode
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer
from moejax.model.sampler import SamplingParams
from moejax.prefetch.steps import Prefetch
from moejax.offload.engine import EngineConfig, OffloadEngine

PROMPT, STREAM = [1, 2, 3, 4, 5], [7, 9, 11, 3, 5, 8]


def _model(layers: int, dtype=jnp.bfloat16, sparse=None):
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=layers,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=16, intermediate_size=48,
                    sparse_layers=sparse or (True,) * layers, qk_norm="head",
                    norm_topk_prob=True).validate()
  rng = np.random.default_rng(layers)
  exps = [{k: (rng.standard_normal((8,) + shp) * 0.2).astype(jnp.dtype(dtype))
           for k, shp in expert_shapes(cfg).items()} if s else None for s in cfg.sparse_layers]
  store = ExpertStore.from_stacked(exps)
  seq = jnp.asarray([PROMPT], jnp.int32)
  params = jax.jit(lambda k: Transformer(cfg).init(k, seq, store.to_device(jnp.float32))[
      "params"])(jax.random.PRNGKey(0))
  return cfg, jax.tree_util.tree_map(lambda a: a.astype(dtype), params), store


def _run(cfg, params, store, scan: bool, policy: str, **kw):
  eng = OffloadEngine(cfg, params, store, EngineConfig.make(
      policy, cache_fraction=kw.pop("fraction", 0.25), dtype="bfloat16", layer_scan=scan, **kw))
  assert eng.program.scan == scan
  logits = [eng.prefill(PROMPT)] + [eng.decode_step(t) for t in STREAM]
  recs = [{k: v for k, v in r.__dict__.items() if "wall" not in k and not k.endswith("_s")}
          for r in eng.records]
  return np.stack(logits), recs, eng.resident_sets(), eng


@pytest.mark.parametrize("policy, kw", [("quality", {}), ("baseline", {}), ("host", {}),
                                        ("fetch_low", {}), ("speed", {"fraction": 1.0}),
                                        ("quality", {"prefetch": Prefetch("previous")}),
                                        ("baseline",
                                         {"prefetch": Prefetch("oracle", "true_router")})])
def test_scan_is_the_unrolled_program_bit_for_bit(policy, kw):
  cfg, params, store = _model(3)
  a = _run(cfg, params, store, False, policy, **dict(kw))
  b = _run(cfg, params, store, True, policy, **dict(kw))
  assert a[2] == b[2]
  if cpu_kernel.available():    # the kernels sum every output in one fixed order
    chex.assert_trees_all_equal(a[0], b[0])
    assert str(a[1]) == str(b[1])
    return
  # XLA's ops alone fuse the bf16 scan body otherwise: logits and gate masses apart by bf16
  # rounding (up to 2e-3 here), the same decisions
  np.testing.assert_allclose(a[0], b[0], atol=1e-2)
  for ra, rb in zip(a[1], b[1], strict=True):
    assert str(ra["layers"]) == str(rb["layers"])
    for k, v in ra.items():
      if k != "layers":
        np.testing.assert_allclose(v, rb[k], atol=1e-2, err_msg=k)


def test_generate_loop_samples_the_same_tokens():
  cfg, params, store = _model(3)
  sp = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8)
  toks = [OffloadEngine(cfg, params, store, EngineConfig.make(
      "quality", dtype="bfloat16", layer_scan=scan)).generate(PROMPT, sp, seed=3)
          for scan in (False, True)]
  assert toks[0] == toks[1] and len(toks[0]) == 8


def _custom_calls(layers: int, scan: bool) -> dict:
  cfg, params, store = _model(layers)
  eng = OffloadEngine(cfg, params, store, EngineConfig.make("quality", dtype="bfloat16",
                                                            layer_scan=scan))
  hlo = decode.step_fn(eng.program).lower(eng.params, eng.sources, eng.new_carry(),
                                          np.int32(0), np.int32(0)).as_text()
  names = re.findall(r"custom_call @(moejax_\w+)", hlo)
  return {n: names.count(n) for n in set(names)}, hlo


@pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ compiler: no kernels")
def test_the_scanned_step_does_not_grow_with_depth():
  (c2, hlo2), (c6, hlo6) = _custom_calls(2, True), _custom_calls(6, True)
  assert c2 == c6 and "moejax_linear_at" in c2 and "moejax_expert_ffn_at" in c2
  assert "stablehlo.while" in hlo6
  # no weight is a constant of the program: its text does not grow with the parameters
  assert abs(len(hlo6) - len(hlo2)) < 0.02 * len(hlo2)
  u2, u6 = _custom_calls(2, False)[0], _custom_calls(6, False)[0]
  assert sum(u6.values()) > sum(u2.values())       # unrolled: one body per layer


def test_what_keeps_unrolling():
  cfg, params, store = _model(3, sparse=(True, False, True))      # a dense layer
  assert not OffloadEngine(cfg, params, store, EngineConfig.make("quality")).program.scan
  cfg, params, store = _model(2)
  apart = ExpertStore({l: LayerExperts(8, stacked={k: np.array(v) for k, v in
                                                   store.stacked(l).items()}) for l in (0, 1)}, 2)
  assert not OffloadEngine(cfg, params, apart, EngineConfig.make("quality")).program.scan
  assert OffloadEngine(cfg, params, store, EngineConfig.make("quality")).program.scan
