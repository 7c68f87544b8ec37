"""Qwen3-Next parity with transformers (tiny random model, f32) and its DeltaNet kernels.

The tiny model has 4 layers: Gated DeltaNet x3 then gated full attention, layer 1
dense, 2 key / 4 value DeltaNet heads (grouped), partial RoPE 0.25.
"""

import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n

from moejax.model import routing
from moejax.model.config import ConfigError, ModelConfig
from moejax.model.families import qwen3_next
from moejax.io.loader import load_model
from moejax.model.model import Transformer, init_cache
from moejax.io.safetensors_io import SafetensorsFile, save_file
from moejax.model.sampler import Sampler, SamplingParams
from tests import hf_models

STEPS = 32


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, tokens, experts, cache=None, end_index=0):
  """Jitted full forward (one compile per shape; eager dispatch is slow on 2 busy cores)."""
  return Transformer(cfg).apply({"params": params}, tokens, experts, cache, end_index)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return hf_models.reference_case("qwen3_next", tmp_path_factory, STEPS, tag="q3n")


# ------------------------------------------------------------ full model
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_prefill_logits_match(reference, layout):
  cfg, params, store = load_model(reference["dirs"][layout])
  assert cfg.model_type == "qwen3_next"
  assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  assert cfg.sparse_layers == (True, False, True, True)
  assert "linear_attn" in params["layers_0"] and "self_attn" in params["layers_3"]
  logits, _, router = _forward(cfg, params, jnp.array([reference["tokens"]]), store.to_device())
  chex.assert_shape(logits, (1, len(reference["tokens"]), cfg.vocab_size))
  np.testing.assert_allclose(np.asarray(logits[0]), reference["pre"], atol=1e-4, rtol=0)
  assert router[1] is None
  chex.assert_shape(router[3], (1, len(reference["tokens"]), cfg.num_experts))


def test_both_layouts_load_the_same_experts(reference):
  _, _, a = load_model(reference["dirs"]["per_expert"])
  _, _, b = load_model(reference["dirs"]["fused"])
  assert a.moe_layers == b.moe_layers == (0, 2, 3)
  for layer in a.moe_layers:
    chex.assert_trees_all_equal(a.stacked(layer), b.stacked(layer))
  assert a.expert_nbytes() == 3 * 32 * 16 * 4          # gate + up + down, f32


def test_cached_decode_and_greedy_generation_match(reference):
  """Layouts load identical arrays (test above), so one layout runs the slow decode check."""
  cfg, params, store = load_model(reference["dirs"]["per_expert"])
  s = Sampler(cfg, params, store.to_device(), max_len=64)
  toks, gen = reference["tokens"], reference["gen"]
  _, cache = s.prefill(np.array([toks]))
  chex.assert_shape(cache[0]["state"], (1, 4, 8, 8))         # [B, Hv, Dk, Dv]
  chex.assert_shape(cache[0]["conv"], (1, 3, 2 * 2 * 8 + 4 * 8))
  chex.assert_shape(cache[3]["k"], (1, 64, 2, 16))
  for i in range(STEPS):
    _, lg, cache = s.decode_step(cache, jnp.array([gen[i]]), len(toks) + i, SamplingParams(),
                                 jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(lg[0]), reference["dec"][i], atol=1e-4, rtol=0)
  out = s.generate(toks, SamplingParams(max_new_tokens=STEPS))
  assert out == gen and len(set(gen)) > 8                  # not a degenerate repetition
  # A 2-token prompt (shorter than the conv kernel), then the rest of the prompt token by
  # token through the recurrent form: the logits equal the chunked prefill's.
  lg2, cache = s.prefill(np.array([toks[:2]]))
  got = [np.asarray(lg2[0])]
  for i in range(2, len(toks)):
    _, lg, cache = s.decode_step(cache, jnp.array([toks[i]]), i, SamplingParams(),
                                 jax.random.PRNGKey(0))
    got.append(np.asarray(lg[0]))
  np.testing.assert_allclose(np.stack(got), reference["pre"][1:], atol=1e-4, rtol=0)


def test_prefill_in_two_pieces_equals_one(reference):
  """Multi-token calls continuing from a cache (conv tail + state + KV) equal one long prefill."""
  cfg, params, store = load_model(reference["dirs"]["fused"])
  ex, toks = store.to_device(), jnp.array([reference["tokens"]])
  first, cache, _ = _forward(cfg, params, toks[:, :6], ex, init_cache(cfg, 1, 32), jnp.int32(0))
  rest, _, _ = _forward(cfg, params, toks[:, 6:], ex, cache, jnp.int32(6))
  got = np.concatenate([np.asarray(first[0]), np.asarray(rest[0])])
  np.testing.assert_allclose(got, reference["pre"], atol=1e-4, rtol=0)


def _hub_like_copy(src: str, dst: str):
  """The hub's shape of a Qwen3-Next folder: hub config spelling, bf16, 2 shards, mtp.* tensors."""
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(src, "config.json")) as f:
    d = json.load(f)
  rope = d.pop("rope_parameters")
  d.pop("layer_types")
  d.update(full_attention_interval=4, partial_rotary_factor=rope["partial_rotary_factor"],
           rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype="bfloat16")
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(d, f)
  src_f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  t = {n: np.asarray(src_f.get(n), np.float32).astype(jnp.bfloat16) for n in src_f.keys()}
  t["mtp.fc.weight"] = np.zeros((32, 64), jnp.bfloat16)          # ignored like HF does
  t["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = np.zeros((16, 32), jnp.bfloat16)
  names = sorted(t)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for shard, ns in shards.items():
    save_file({n: t[n] for n in ns}, os.path.join(dst, shard), {"format": "pt"})
  with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {n: s for s, ns in shards.items() for n in ns}}, f)
  return dst


def test_hub_layout_bf16_sharded_loads_and_runs(reference, tmp_path):
  """Hub config spelling + sharded bf16 + mtp tensors: same config, bf16 logits close to HF."""
  cfg32, _, _ = load_model(reference["dirs"]["per_expert"])
  hub = _hub_like_copy(reference["dirs"]["per_expert"], str(tmp_path / "hub"))
  cfg, params, store = load_model(hub, dtype=jnp.bfloat16)
  assert cfg == cfg32
  chex.assert_type(jax.tree_util.tree_leaves(params), jnp.bfloat16)
  logits, _, _ = _forward(cfg, params, jnp.array([reference["tokens"]]),
                          store.to_device())
  chex.assert_type(logits, jnp.float32)
  err = np.abs(np.asarray(logits[0]) - reference["pre"]).max()
  assert err < 0.05, err


def test_every_component_matters(reference):
  """Perturbing a DeltaNet, the shared-expert gate or a zero-centred norm moves the logits."""
  cfg, params, store = load_model(reference["dirs"]["fused"])
  ex, toks = store.to_device(), jnp.array([reference["tokens"]])
  base, _, _ = _forward(cfg, params, toks, ex)
  for path in (("layers_0", "linear_attn", "A_log"), ("layers_2", "mlp", "shared_expert_gate", "weight"),
               ("layers_3", "self_attn", "q_norm", "weight"), ("norm", "weight")):
    p2 = jax.tree_util.tree_map(lambda x: x, params)
    d = p2
    for k in path[:-1]:
      d = d[k]
    d[path[-1]] = d[path[-1]] + 0.5
    out, _, _ = _forward(cfg, p2, toks, ex)
    assert np.abs(np.asarray(out - base)).max() > 1e-4, path


# ----------------------------------------------------------- DeltaNet rule
def _rule_inputs(seed, b=1, t=100, nk=2, nv=4, dk=8, dv=6):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  q, k, v = f(b, t, nk, dk), f(b, t, nk, dk), f(b, t, nv, dv)
  g = -np.exp(f(b, t, nv) * 0.5) * 0.3                   # log decays < 0
  beta = 1 / (1 + np.exp(-f(b, t, nv)))
  state = f(b, nv, dk, dv)
  return q, k, v, g, beta, state


def test_chunked_equals_recurrent():
  """The chunked prefill form equals the token-by-token form (several chunks + a ragged tail)."""
  args = [jnp.asarray(a) for a in _rule_inputs(0)]
  o_r, s_r = qwen3_next.recurrent_gated_delta_rule(*args)
  o_c, s_c = qwen3_next.chunked_gated_delta_rule(*args, chunk=16)   # 7 chunks, ragged tail
  np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=2e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), atol=2e-4, rtol=0)
  assert np.abs(np.asarray(o_r)).max() > 0.1


def test_rule_matches_transformers_reference():
  """Both forms (chunked at the model's 64) equal transformers' torch kernels, final state too."""
  q, k, v, g, beta, state = _rule_inputs(1)   # same shapes as above: no recompile
  t = lambda a: torch.from_numpy(a)
  kw = dict(initial_state=t(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
  ref_o, ref_s = hf_q3n.torch_recurrent_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), **kw)
  ref_oc, _ = hf_q3n.torch_chunk_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), **kw)
  np.testing.assert_allclose(ref_oc.numpy(), ref_o.numpy(), atol=2e-4, rtol=0)
  args = [jnp.asarray(a) for a in (q, k, v, g, beta, state)]
  for fn in (qwen3_next.recurrent_gated_delta_rule, qwen3_next.chunked_gated_delta_rule):
    o, s = fn(*args)
    np.testing.assert_allclose(np.asarray(o), ref_o.numpy(), atol=2e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), atol=2e-4, rtol=0)


# ------------------------------------------------------------------ router
def test_router_matches_transformers_512_experts():
  """A Qwen3-Next-sized router (512 experts, top-10, norm_topk_prob): ids and gates equal HF's."""
  hf_cfg = transformers.Qwen3NextConfig(hidden_size=64, num_experts=512, num_experts_per_tok=10,
                                        norm_topk_prob=True, num_hidden_layers=4)
  torch.manual_seed(0)
  router = hf_q3n.Qwen3NextTopKRouter(hf_cfg)
  with torch.no_grad():
    router.weight.normal_(0, 0.3)
  x = torch.randn(16, 64)
  with torch.no_grad():
    logits, gates_ref, ids_ref = router(x)
  cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
  assert (cfg.num_experts, cfg.top_k, cfg.router) == (512, 10, "softmax")
  ids, gates, scores = routing.route(cfg, jnp.asarray(logits.numpy()))
  np.testing.assert_array_equal(np.asarray(ids), ids_ref.numpy())
  np.testing.assert_allclose(np.asarray(gates), gates_ref.numpy(), atol=1e-6)
  np.testing.assert_allclose(np.asarray(gates).sum(-1), 1.0, atol=1e-5)
  assert np.all(np.diff(np.take_along_axis(np.asarray(scores), np.asarray(ids), -1), axis=-1) <= 0)


# ------------------------------------------------------------------ config
HUB_CONFIG = {  # Qwen3-Next-80B-A3B-Instruct config.json (hub spelling)
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256,
    "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "vocab_size": 151936,
}


def test_hub_config_spelling():
  cfg = ModelConfig.from_hf_dict(HUB_CONFIG)
  assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
  assert sum(t == "full_attention" for t in cfg.layer_types) == 12
  assert qwen3_next.rotary_dim(cfg) == 64 and cfg.rope_theta == 1e7
  assert cfg.moe_layers == tuple(range(48)) and cfg.family_config.shared_expert_intermediate_size == 512
  hash(cfg)
  # bytes one routed expert moves per miss in bf16: 3 * hidden * moe_intermediate * 2
  assert cfg.expert_param_count * 2 == 6_291_456


def test_config_errors_name_the_field():
  with pytest.raises(ConfigError, match="linear_num_value_heads"):
    ModelConfig.from_hf_dict({**HUB_CONFIG, "linear_num_value_heads": 24, "linear_num_key_heads": 16,
                              "num_hidden_layers": 4})
  with pytest.raises(ConfigError, match="layer_types"):
    ModelConfig.from_hf_dict({**HUB_CONFIG, "num_hidden_layers": 4,
                              "layer_types": ["linear_attention", "mamba", "x", "full_attention"]})
  with pytest.raises(ConfigError, match="linear_key_head_dim"):
    ModelConfig.from_hf_dict({k: v for k, v in HUB_CONFIG.items() if k != "linear_key_head_dim"})


# ------------------------------------------------------------------ offload
def test_offload_engine_fetch_all_equals_resident_model(reference):
  """The engine with 2 of 8 experts resident per layer, fetching every miss, gives the
  resident model's (and transformers') logits; the shared expert stays a dense parameter."""
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = load_model(reference["dirs"]["per_expert"])
  toks, gen = reference["tokens"], reference["gen"]
  steps = 8
  with OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=0.25,
                                                           max_len=32)) as eng:
    assert eng.budget.slots == 2 and set(eng.states) == {0, 2, 3}
    out = [eng.prefill(toks)] + [eng.decode_step(t) for t in gen[:steps]]
    st = eng.stats()
  ref = np.stack([reference["pre"][-1]] + reference["dec"][:steps])
  np.testing.assert_allclose(np.stack(out), ref, atol=1e-4, rtol=0)
  assert st["fetches_per_token"] > 0 and st["hit_rate"] < 1           # the cache really missed
  assert eng.prefill_record["fetches"] > 0
