"""gpt_oss: parity with transformers (float and MXFP4 checkpoints), YaRN, experts (the MXFP4
codec: tests/test_mxfp4.py).

One tiny random GptOssForCausalLM (3 layers sliding/full/sliding, window 4 < the
12-token prompt, 16 experts top-4, default YaRN) whose routed experts are first
rounded to MXFP4 (and their biases to bf16), so that the same weights exist as
  * ``fused``: what ``save_pretrained`` writes (float ``gate_up_proj`` [E, D, 2I] ...),
  * ``mxfp4``: a hub-layout folder written here (``*_blocks``/``*_scales`` uint8, bf16
    biases, hub config.json spelling), loaded kept as MXFP4 (device dequantises) and
    dequantised on load.
"""

import dataclasses
import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from moejax.model import experts as experts_lib
from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.model.families import gpt_oss, mxfp4
from moejax.model.families.configs.gpt_oss import DEFAULT_YARN
from moejax.io.loader import load_model
from moejax.model.model import Transformer
from moejax.io.safetensors_io import CheckpointError, save_file
from tests import hf_models
from tests.test_mxfp4 import reference_dequantize

LAYOUTS = ["fused", "mxfp4", "mxfp4_dequantized"]

# config.json of openai/gpt-oss-20b as published on the hub (hub spelling).
HUB_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


# ------------------------------------------------------------ config and rope
def test_config_hub_and_v5_spellings(tmp_path):
  hub = ModelConfig.from_hf_dict(HUB_20B)
  assert hub.router == "topk_softmax" and hub.num_experts == 32 and hub.top_k == 4
  assert hub.family_config.sliding_window == 128
  assert hub.layer_types[:2] == ("sliding_attention", "full_attention")
  assert hub.rope_theta == 150000.0 and dict(hub.rope_scaling)["factor"] == 32.0
  assert hub.attention_bias and hub.moe_intermediate_size == 2880 and hub.rms_norm_eps == 1e-5
  hash(hub)  # a jit static argument
  # transformers v5 writes rope_parameters (with rope_theta inside) instead
  v5_dir = str(tmp_path / "v5")
  transformers.GptOssConfig(num_hidden_layers=2, sliding_window=4).save_pretrained(v5_dir)
  v5 = ModelConfig.from_json_file(v5_dir)
  assert v5.rope_scaling == hub.rope_scaling and v5.rope_theta == hub.rope_theta
  assert v5.family_config.sliding_window == 4 and v5.layer_types == ("sliding_attention", "full_attention")
  with pytest.raises(ValueError, match="layer_types"):
    ModelConfig.from_hf_dict({**HUB_20B, "layer_types": ["sliding_attention"]})
  with pytest.raises(ValueError, match="rope_scaling"):
    ModelConfig.from_hf_dict({**HUB_20B, "rope_scaling": {"rope_type": "longrope"}})


@pytest.mark.parametrize("over", [{}, {"truncate": True}, {"factor": 8.0, "beta_fast": 16.0}])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_yarn_matches_transformers(over, head_dim):
  rope = {**DEFAULT_YARN, **over, "rope_theta": 150000.0}
  hf_cfg = transformers.GptOssConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                     head_dim=head_dim, num_hidden_layers=2,
                                     rope_parameters=dict(rope))
  inv_ref, attn_ref = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
  cfg = ModelConfig.from_hf_dict({**HUB_20B, "head_dim": head_dim, "rope_scaling": None,
                                  "rope_parameters": rope})
  inv, attn = gpt_oss.rope_inv_freq(cfg)
  np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=1e-6)
  assert attn == pytest.approx(attn_ref) and attn > 1.0


# ------------------------------------------------------------ router, experts
def test_router_matches_transformers():
  torch.manual_seed(0)
  hf_cfg = transformers.GptOssConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=4,
                                     num_hidden_layers=2)
  router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(hf_cfg)
  torch.nn.init.normal_(router.weight, std=0.5)
  torch.nn.init.normal_(router.bias, std=0.5)
  x = torch.randn(10, 32)
  logits, weights, ids = router(x)
  cfg = ModelConfig.from_hf_dict({**HUB_20B, "num_local_experts": 16})
  my_ids, gates, scores = routing.route(cfg, jnp.asarray(logits.detach().numpy()))
  np.testing.assert_array_equal(np.asarray(my_ids), ids.numpy())
  np.testing.assert_allclose(np.asarray(gates), weights.detach().numpy(), atol=1e-6)
  np.testing.assert_allclose(np.asarray(gates).sum(-1), 1.0, atol=1e-6)
  assert (np.diff(np.take_along_axis(np.asarray(scores), np.asarray(my_ids), 1)) <= 0).all()


def _hf_experts(seed=0, e=8, d=32, i=32):
  torch.manual_seed(seed)
  hf_cfg = transformers.GptOssConfig(hidden_size=d, intermediate_size=i, num_local_experts=e,
                                     num_hidden_layers=2)
  ex = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(hf_cfg)
  with torch.no_grad():
    ex.gate_up_proj.normal_(0, 0.3)
    ex.down_proj.normal_(0, 0.3)
    ex.gate_up_proj_bias.normal_(0, 3.0)
    ex.down_proj_bias.normal_(0, 1.0)
  return ex


def _float_dict(ex) -> dict:
  return {"gate_up": ex.gate_up_proj.detach().numpy().transpose(0, 2, 1),
          "gate_up_bias": ex.gate_up_proj_bias.detach().numpy(),
          "down": ex.down_proj.detach().numpy().transpose(0, 2, 1),
          "down_bias": ex.down_proj_bias.detach().numpy()}


# sliced (decode: 2 tokens x top-4 = FAMILY_SLICED_MAX_PAIRS) and grouped (prefill) paths
@pytest.mark.parametrize("n", [2, 40])
def test_experts_match_transformers_float_and_mxfp4(n):
  assert (n * 4 <= experts_lib.FAMILY_SLICED_MAX_PAIRS) == (n == 2)   # both paths are run
  ex = _hf_experts()
  w = _float_dict(ex)
  q = gpt_oss.quantize_experts(w)
  deq = dict(w, gate_up=mxfp4.dequantize_np(q["gate_up_blocks"], q["gate_up_scales"]),
             down=mxfp4.dequantize_np(q["down_blocks"], q["down_scales"]))
  rng = np.random.default_rng(n)
  x = rng.standard_normal((n, 32)).astype(np.float32)
  logits = rng.standard_normal((n, 8)).astype(np.float32)
  ids = np.argsort(-logits, axis=1)[:, :4]
  gates = jax.nn.softmax(np.take_along_axis(logits, ids, 1), axis=-1)
  for weights, quantised in ((w, False), (q, True)):
    if quantised:  # reference: transformers on the dequantised weights
      with torch.no_grad():
        ex.gate_up_proj.copy_(torch.from_numpy(deq["gate_up"].transpose(0, 2, 1).copy()))
        ex.down_proj.copy_(torch.from_numpy(deq["down"].transpose(0, 2, 1).copy()))
    ref = ex(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(np.asarray(gates)))
    got = jax.jit(experts_lib.apply_experts)(jnp.asarray(x), jnp.asarray(ids, jnp.int32), gates,
                                             {k: jnp.asarray(v) for k, v in weights.items()})
    np.testing.assert_allclose(np.asarray(got), ref.detach().numpy(), atol=1e-4, rtol=1e-5)
  # the clamp was exercised: some gate/up pre-activations lie beyond +-7
  pre = np.einsum("nd,eid->nei", x, w["gate_up"]) + w["gate_up_bias"]
  assert (pre[..., 0::2] > 7).any() and (np.abs(pre[..., 1::2]) > 7).any()


def test_real_checkpoint_bytes_per_expert():
  """The figure a miss moves for GPT-OSS-20B/120B: MXFP4 blocks + scales + bf16 biases."""
  for layers, experts in ((24, 32), (36, 128)):
    types = ["sliding_attention", "full_attention"] * (layers // 2)
    cfg = ModelConfig.from_hf_dict({**HUB_20B, "num_hidden_layers": layers,
                                    "num_local_experts": experts, "layer_types": types})
    shapes = gpt_oss.expert_shapes(cfg, "mxfp4")
    nbytes = sum(int(np.prod(s)) * (2 if k.endswith("bias") else 1) for k, s in shapes.items())
    assert nbytes == 13_236_480
    fshapes = gpt_oss.expert_shapes(cfg, "float")
    assert sum(int(np.prod(s)) * 2 for s in fshapes.values()) == 49_766_400 + 2 * (3 * 2880)


# --------------------------------------------------------------- model parity
def _round_experts_to_mxfp4(model):
  """Make the HF model's experts exactly MXFP4-representable (biases bf16-representable)."""
  with torch.no_grad():
    for layer in model.model.layers:
      ex = layer.mlp.experts
      for name in ("gate_up_proj", "down_proj"):
        p = getattr(ex, name)
        b, s = mxfp4.quantize(p.numpy().transpose(0, 2, 1))
        deq = reference_dequantize(b, s).astype(np.float32)
        p.copy_(torch.from_numpy(deq.transpose(0, 2, 1)))
      for name in ("gate_up_proj_bias", "down_proj_bias"):
        p = getattr(ex, name)
        p.copy_(p.to(torch.bfloat16).float())


def _write_mxfp4_hub_folder(model, out_dir):
  """The layout of openai/gpt-oss-*: MXFP4 experts, bf16 expert biases, hub config spelling."""
  os.makedirs(out_dir, exist_ok=True)
  t = {}
  for name, p in model.state_dict().items():
    a = p.detach().numpy()
    if ".mlp.experts." not in name:
      t[name] = a.astype(np.float32)
    elif name.endswith("_bias"):
      t[name] = a.astype(ml_dtypes.bfloat16)
    else:  # gate_up_proj [E, D, 2I] / down_proj [E, I, D]: the hub stores [E, out, in] blocks
      b, s = mxfp4.quantize(a.transpose(0, 2, 1))
      t[name + "_blocks"], t[name + "_scales"] = b, s
  save_file(t, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
  c = model.config
  rope = dict(c.rope_parameters)
  hub = {**HUB_20B, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
         "head_dim": c.head_dim, "num_attention_heads": c.num_attention_heads,
         "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": c.num_hidden_layers,
         "num_local_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok,
         "experts_per_token": c.num_experts_per_tok, "layer_types": list(c.layer_types),
         "vocab_size": c.vocab_size, "sliding_window": c.sliding_window,
         "max_position_embeddings": c.max_position_embeddings, "eos_token_id": None,
         "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hub, f)
  return out_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  model = hf_models.build("gpt_oss")
  _round_experts_to_mxfp4(model)
  tokens = [int(t) for t in np.random.default_rng(1).integers(0, 96, 12)]
  pre, dec, gen = hf_models.reference(model, tokens, 32)
  fused = hf_models.save(model, str(tmp_path_factory.mktemp("gpt_oss_fused")), "fused")
  hub = _write_mxfp4_hub_folder(model, str(tmp_path_factory.mktemp("gpt_oss_mxfp4")))
  return dict(tokens=tokens, pre=pre, dec=dec, gen=gen, dirs={"fused": fused, "mxfp4": hub})


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, tokens_BxT, experts):
  """Jitted full forward, shared by the tests (one compile per config and expert layout)."""
  return Transformer(cfg).apply({"params": params}, tokens_BxT, experts)


def _load(reference, layout, **kw):
  d = reference["dirs"]["fused" if layout == "fused" else "mxfp4"]
  return load_model(d, dequantize_mxfp4=layout == "mxfp4_dequantized", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_logits_match(reference, layout):
  cfg, params, store = _load(reference, layout)
  assert cfg.model_type == "gpt_oss" and cfg.family_config.sliding_window == 4
  experts = store.to_device()
  if layout == "mxfp4":  # 4-bit bytes on the device; dequantised inside the expert computation
    assert experts[0]["gate_up_blocks"].dtype == jnp.uint8 and "gate_up" not in experts[0]
  logits, _, router = _forward(cfg, params, jnp.array([reference["tokens"]]), experts)
  chex.assert_shape(logits, (1, len(reference["tokens"]), cfg.vocab_size))
  np.testing.assert_allclose(np.asarray(logits[0]), reference["pre"], atol=1e-4, rtol=0)
  assert len(router) == cfg.num_layers


@pytest.mark.parametrize("layout", ["fused", "mxfp4"])  # dequantised-on-load == fused weights
def test_cached_decode_and_greedy_generation_match(reference, layout):
  cfg, params, store = _load(reference, layout)
  hf_models.assert_cached_decode_and_greedy_match(cfg, params, store, reference)


def test_bf16_mxfp4_runs_close_to_f32(reference):
  """bf16 compute: the device dequantises the same 4-bit bytes into bf16."""
  cfg, params, store = _load(reference, "mxfp4", dtype=jnp.bfloat16)
  chex.assert_type(params["layers_0"]["self_attn"]["sinks"], jnp.bfloat16)
  logits, _, _ = jax.jit(Transformer(cfg, jnp.bfloat16).apply)(
      {"params": params}, jnp.array([reference["tokens"]]), store.to_device(jnp.bfloat16))
  chex.assert_type(logits, jnp.float32)
  assert np.abs(np.asarray(logits[0]) - reference["pre"]).max() < 0.05


def test_sliding_window_and_sinks_are_exercised(reference):
  """Without the window, or without sinks, the model no longer matches: both are live."""
  cfg, params, store = _load(reference, "fused")
  toks = jnp.array([reference["tokens"]])
  full = dataclasses.replace(
      cfg, family_config=dataclasses.replace(cfg.family_config, sliding_window=10_000))
  lg_full, _, _ = _forward(full, params, toks, store.to_device())
  assert np.abs(np.asarray(lg_full[0]) - reference["pre"]).max() > 1e-3
  no_sink = jax.tree_util.tree_map_with_path(
      lambda p, v: jnp.full_like(v, -1e9) if p[-1].key == "sinks" else v, params)
  lg_ns, _, _ = _forward(cfg, no_sink, toks, store.to_device())
  assert np.abs(np.asarray(lg_ns[0]) - reference["pre"]).max() > 1e-3


def test_mxfp4_store_moves_4bit_bytes(reference):
  cfg, _, store = _load(reference, "mxfp4")
  _, _, deq = _load(reference, "mxfp4_dequantized")
  e = store.get(0, 3)
  assert set(e) == set(gpt_oss.MXFP4_KEYS)
  assert e["gate_up_blocks"].dtype == np.uint8 and e["down_scales"].dtype == np.uint8
  d, i = cfg.hidden_size, cfg.moe_intermediate_size
  weights = 3 * d * i
  assert store.expert_nbytes(0) == weights // 2 + weights // 32 + 4 * (2 * i + d)
  assert deq.expert_nbytes(0) == 4 * (weights + 2 * i + d)
  # the device dequantisation of the stored bytes equals the dequantise-on-load table
  got = jax.jit(mxfp4.dequantize)(e["gate_up_blocks"], e["gate_up_scales"])
  np.testing.assert_array_equal(np.asarray(got), deq.get(0, 3)["gate_up"])
  # mmap: the store reads the checkpoint's bytes in place
  _, _, mm = _load(reference, "mxfp4", mmap=True)
  assert isinstance(mm.stacked(1)["down_blocks"], np.memmap)
  np.testing.assert_array_equal(mm.get(1, 5)["down_blocks"], store.get(1, 5)["down_blocks"])
  # bf16 load keeps the 4-bit bytes and casts only the biases
  _, _, st16 = _load(reference, "mxfp4", dtype=jnp.bfloat16)
  e16 = st16.get(1, 0)
  assert e16["gate_up_blocks"].dtype == np.uint8 and e16["down_bias"].dtype == ml_dtypes.bfloat16
  dev = st16.to_device(jnp.bfloat16)
  assert dev[1]["down_blocks"].dtype == jnp.uint8 and dev[1]["down_bias"].dtype == jnp.bfloat16


def test_loader_errors_name_the_tensor(reference, tmp_path):
  src = reference["dirs"]["mxfp4"]
  from moejax.io.safetensors_io import SafetensorsFile
  f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  tensors = {k: np.array(f.get(k)) for k in f.keys()}
  bad = str(tmp_path / "bad")
  os.makedirs(bad)
  with open(os.path.join(src, "config.json")) as fh:
    conf = fh.read()
  with open(os.path.join(bad, "config.json"), "w") as g:
    g.write(conf)
  name = "model.layers.1.mlp.experts.down_proj_scales"
  for mutate, msg in ((lambda t: t.pop(name), "missing tensor.*down_proj_scales"),
                      (lambda t: t.__setitem__(name, t[name].astype(np.float32)), "U8"),
                      (lambda t: t.__setitem__(name, t[name][:, :-1]), "down_proj_scales.*shape")):
    t = dict(tensors)
    mutate(t)
    save_file(t, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=msg):
      load_model(bad)


def test_host_policy_on_float_experts_equals_the_resident_model(reference):
  """The `host` policy computes every miss inside the decode program from the store (here
  float experts with gpt_oss's biases and clamped SwiGLU): at a 25% budget the engine gives
  the fully resident model's logits, teacher-forced on the prompt and transformers' tokens."""
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = _load(reference, "fused")
  toks, gen = reference["tokens"], reference["gen"][:8]
  full, _, _ = _forward(cfg, params, jnp.array([toks + gen]), store.to_device())
  full, t = np.asarray(full[0]), len(toks)
  config = EngineConfig.make("host", cache_fraction=0.25, max_len=32)
  with OffloadEngine(cfg, params, store, config) as eng:
    out = [eng.prefill(toks)] + [eng.decode_step(tok) for tok in gen]
    np.testing.assert_allclose(np.stack(out), full[t - 1:], atol=1e-5, rtol=0)
    st = eng.stats()
    assert st["host_calls_per_token"] > 0 and st["fetches_per_token"] == 0
    assert st["substituted_call_pct"] == 0


@pytest.mark.parametrize("policy", ["fetch_all", "host"])
def test_offload_engine_matches_transformers(reference, policy):
  """At a 25% budget the engine reproduces transformers on the MXFP4 checkpoint: fetch_all
  moves the 4-bit bytes (blocks + scales + biases) and the device dequantises them; `host`
  computes the missed experts on the host from the same bytes."""
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = _load(reference, "mxfp4")
  toks, gen = reference["tokens"], reference["gen"][:8]
  with OffloadEngine(cfg, params, store, EngineConfig.make(policy, cache_fraction=0.25, max_len=32)) as eng:
    np.testing.assert_allclose(eng.prefill(toks), reference["pre"][-1], atol=1e-4, rtol=0)
    for i, tok in enumerate(gen):
      np.testing.assert_allclose(eng.decode_step(tok), reference["dec"][i], atol=1e-4, rtol=0)
    st = eng.stats()
    assert st["substituted_call_pct"] == 0
    buf = eng.states[0].buffers
    assert buf["gate_up_blocks"].dtype == jnp.uint8 and "gate_up" not in buf
    if policy == "fetch_all":
      assert st["fetches_per_token"] > 0
      fetched = sum(r["fetches"] for r in eng.records)
      assert sum(r["fetch_bytes"] for r in eng.records) == fetched * store.expert_nbytes()
    else:
      assert sum(r["host_calls"] for r in eng.records) > 0
