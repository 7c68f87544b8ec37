"""--weights: a float checkpoint repacked once into ggml blocks (io.weights.quantized), run
end to end by the all-resident Sampler and the offload engine (experts fetched as blocks,
dequantized in the program), against the float model."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.ggml.qarray import QuantArray
from moejax.io import quant
from moejax.io.loader import init_random, load_model, save_hf
from moejax.io.weights import quantized
from moejax.model.config import ModelConfig
from moejax.model.sampler import Sampler, SamplingParams
from moejax.offload.config import EngineConfig
from moejax.offload.engine import OffloadEngine
from moejax.offload.memory import plan_memory

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8, top_k=2,
                  moe_intermediate_size=256, intermediate_size=512,
                  sparse_layers=(True, False), qk_norm="head")
PROMPT = [1, 5, 9, 3, 7, 2]
# max |logit - float logit| over the prompt's last position, on this random model whose
# logits span about +-1 (measured: q8_0 0.009, q6_k 0.04, q4_0 / q4_k 0.16)
TOL = {"q8_0": 0.03, "q6_k": 0.1, "q4_0": 0.35, "q4_k": 0.35}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("weights") / "tiny")
  params, exps = init_random(CFG, seed=0)
  save_hf(CFG, params, exps, d)
  cfg, p, s = load_model(d, dtype=jnp.float32)
  logits = Sampler(cfg, p, s.device_experts(jnp.float32), max_len=32).prefill(
      np.array([PROMPT]))[0]
  return d, np.asarray(logits)


@pytest.mark.parametrize("qtype", list(TOL))
def test_quantized_model_is_close_to_float(folder, qtype):
  d, ref = folder
  cfg, params, store = load_model(d, dtype=jnp.float32, weights=qtype)
  attn = params["layers_0"]["self_attn"]
  assert isinstance(attn["q_proj"]["weight"], QuantArray)
  assert attn["q_proj"]["weight"].qtype == qtype
  assert isinstance(params["embed_tokens"]["embedding"], QuantArray)
  assert isinstance(params["layers_1"]["mlp"]["down_proj"]["weight"], QuantArray)
  assert not isinstance(params["layers_0"]["mlp"]["gate"]["weight"], QuantArray)   # router
  assert not isinstance(attn["q_norm"]["weight"], QuantArray)
  assert sorted(store.stacked(0)) == sorted([f"down@{qtype}", f"gate_up@{qtype}"])
  assert store.expert_nbytes() == quantized.expert_nbytes(cfg, qtype)
  s = Sampler(cfg, params, store.device_experts(jnp.float32), max_len=32)
  logits = np.asarray(s.prefill(np.array([PROMPT]))[0])
  assert np.abs(logits - ref).max() < TOL[qtype]


def test_repack_is_reused_and_the_plan_counts_blocks(folder):
  d, _ = folder
  path = quantized.weights_path(d, "q4_0")
  load_model(d, weights="q4_0")
  mtime = os.stat(path).st_mtime_ns
  load_model(d, weights="q4_0")
  assert os.stat(path).st_mtime_ns == mtime            # mapped, not rewritten
  plan = plan_memory(CFG, jnp.float32, offload=True, cache_fraction=0.25, kv_len=32,
                     weights="q4_0")
  assert plan.expert_bytes == quantized.expert_nbytes(CFG, "q4_0") == 256 * 144 * 3
  f32 = plan_memory(CFG, jnp.float32, offload=True, cache_fraction=0.25, kv_len=32)
  assert f32.expert_bytes == 4 * 256 * 256 * 3 and plan.dense_bytes < f32.dense_bytes / 3


@pytest.mark.parametrize("mmap,dtype", [(True, jnp.float32), (False, jnp.bfloat16)])
def test_engine_on_a_quantized_store_matches_its_sampler(folder, mmap, dtype):
  d, _ = folder
  cfg, params, store = load_model(d, dtype=dtype, weights="q4_k", mmap=mmap)
  sp = SamplingParams(max_new_tokens=6)
  ref = Sampler(cfg, params, store.device_experts(dtype), max_len=32, dtype=dtype).generate(
      PROMPT, sp)
  config = EngineConfig.make("baseline", cache_fraction=0.25, max_len=32, dtype=dtype)
  with OffloadEngine(cfg, params, store, config) as eng:
    assert eng.generate(PROMPT, sp) == ref
    assert eng.store.expert_nbytes() == quantized.expert_nbytes(cfg, "q4_k")


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k"])
def test_host_experts_read_the_quantized_store_in_place(folder, qtype):
  """--policy=host on GGUF blocks: the missed experts run from the store where it lives
  (the routed kernel by id, no slicing), exact: the logits of the baseline's (every miss
  fetched), within the f32 rounding of adding the host part apart."""
  d, _ = folder
  cfg, params, store = load_model(d, dtype=jnp.float32, weights=qtype, mmap=True)
  out = {}
  for name in ("baseline", "host"):
    config = EngineConfig.make(name, cache_fraction=0.25, max_len=32)
    with OffloadEngine(cfg, params, store, config) as eng:
      out[name] = [np.asarray(eng.prefill(PROMPT[:3]))]
      out[name] += [np.asarray(eng.decode_step(t)) for t in PROMPT[3:]]
      stats = eng.stats()
    if name == "host":
      assert stats["host_calls_per_token"] > 0 and stats["fetches_per_token"] == 0
  np.testing.assert_allclose(np.stack(out["host"]), np.stack(out["baseline"]), atol=1e-5,
                             rtol=1e-5)


def test_host_experts_run_the_kernel_on_the_store_without_slicing(folder):
  """The program of HOST experts on GGUF blocks calls the routed kernel on the store and
  slices no expert out of it (the slicing copied all K experts' blocks each step: Q4_0's
  wide model ran --policy=host at 20.2 ms a token, 8.4-9.3 ms reading in place)."""
  import jax
  from types import SimpleNamespace
  from moejax.kernels import cpu_kernel
  from moejax.offload import sources
  if not cpu_kernel.available():
    pytest.skip("no C++ compiler: the kernels are not built")
  d, _ = folder
  cfg, _, store = load_model(d, dtype=jnp.float32, weights="q4_0")
  w = {k: jnp.asarray(v) for k, v in store.stacked(0).items()}
  ctx = SimpleNamespace(pinned=False, cfg=cfg)
  x = jnp.ones((1, cfg.hidden_size), jnp.float32)
  ids, gates = jnp.asarray([[1, 3]], jnp.int32), jnp.asarray([[0.5, 0.0]], jnp.float32)
  fn = lambda x, i, g, w: sources.host_experts(ctx, w, {k: v.dtype for k, v in w.items()},
                                               x, i, g)
  text = jax.jit(fn).lower(x, ids, gates, w).as_text()
  assert cpu_kernel.EXPERT_FFN_Q_TARGET in text and "dynamic_slice" not in text


def test_refusals_name_the_flag(folder):
  d, _ = folder
  with pytest.raises(quantized.WeightsError, match="--weights='q5_k'.*choose one of"):
    load_model(d, weights="q5_k")
  _, _, store = load_model(d, weights="q8_0")
  with pytest.raises(quant.QuantError, match="fetch_low.*ggml blocks"):
    quant.build(store, 8)
