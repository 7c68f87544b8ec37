"""glm4_moe, glm4_moe_lite (MLA) and deepseek_v3 (MLA): parity with transformers, routing rule.

Tiny random models (f32, eager) saved with ``save_pretrained`` in both expert
layouts; prefill logits and 32 cached decode steps within 1e-4, greedy
generations identical.  The sigmoid_group router is pinned on a hand-checked
case and against the transformers router module itself.
"""

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moejax.model import routing
from moejax.model.config import ConfigError, ModelConfig
from moejax.model.families.configs.glm import GlmConfig
from moejax.model.layers import gqa_attention
from moejax.io.loader import load_model
from moejax.model.model import Transformer
from moejax.io.safetensors_io import SafetensorsFile, save_file
from tests import hf_models

FAMILIES = ["glm4_moe", "glm4_moe_lite", "deepseek_v3"]


def _forward(cfg, params, experts, tokens, dtype=jnp.float32, positions=None):
  """Jitted full forward (one compile is cheaper than eager op-by-op dispatch)."""
  fn = jax.jit(lambda p, t, e, pos: Transformer(cfg, dtype).apply({"params": p}, t, e,
                                                                  positions_BxT=pos))
  return fn(params, jnp.asarray(tokens), experts, None if positions is None
            else jnp.asarray(positions))


def _only(reference, family: str):
  """Family-agnostic paths (loader, engine, dtype) run on one family to keep the file fast."""
  if reference["family"] != family:
    pytest.skip(f"covered by the {family} case")


reference = hf_models.reference_fixture(FAMILIES)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_prefill_logits_match(reference, layout):
  cfg, params, store = load_model(reference["dirs"][layout])
  assert cfg.model_type == reference["family"] and cfg.router == "sigmoid_group"
  assert store.moe_layers == cfg.moe_layers == (1, 2)     # first layer dense in all three
  logits, _, router = _forward(cfg, params, store.to_device(), [reference["tokens"]])
  chex.assert_shape(logits, (1, len(reference["tokens"]), cfg.vocab_size))
  np.testing.assert_allclose(np.asarray(logits[0]), reference["pre"], atol=1e-4, rtol=0)
  assert router[0] is None
  chex.assert_shape(router[1], (1, len(reference["tokens"]), 2 * cfg.num_experts))


def test_cached_decode_and_greedy_generation_match(reference):
  cfg, params, store = load_model(reference["dirs"]["fused"])
  hf_models.assert_cached_decode_and_greedy_match(cfg, params, store, reference)


def test_router_matches_transformers_and_bias_is_loaded(reference):
  """route() on our layer-1 router output == the HF router module (ids as sets, gates)."""
  cfg, params, _ = load_model(reference["dirs"]["per_expert"])
  hf_gate = reference["model"].model.layers[1].mlp.gate
  bias = hf_gate.e_score_correction_bias.numpy()
  assert np.abs(bias).max() > 0.05                         # the test would see a dropped bias
  np.testing.assert_array_equal(np.asarray(params["layers_1"]["mlp"]["gate"]
                                           ["e_score_correction_bias"]), bias)
  x = np.random.default_rng(2).standard_normal((64, cfg.hidden_size)).astype(np.float32)
  with torch.no_grad():
    _, w_ref, i_ref = hf_gate(torch.from_numpy(x))
  layer = Transformer(cfg).bind({"params": params}).layers[1]
  ids, gates, _ = routing.route(cfg, layer.mlp(jnp.asarray(x)))
  order = np.argsort(i_ref.numpy(), axis=-1)
  got = np.argsort(np.asarray(ids), axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), got, -1),
                                np.take_along_axis(i_ref.numpy(), order, -1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(gates), got, -1),
                             np.take_along_axis(w_ref.numpy(), order, -1), atol=1e-6)
  # gates are the weights the model applies: normalised share * routed_scaling_factor
  np.testing.assert_allclose(np.asarray(gates).sum(-1), cfg.family_config.routed_scaling_factor,
                             rtol=1e-5)


def _cfg(**over):
  """A deepseek_v3 router config; `over` sets ModelConfig and GlmConfig fields alike."""
  kw = dict(model_type="deepseek_v3", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
            num_kv_heads=1, head_dim=8, num_experts=8, top_k=2, moe_intermediate_size=4,
            intermediate_size=4, sparse_layers=(True,), router="sigmoid_group",
            norm_topk_prob=True)
  fam = dict(n_group=4, topk_group=2, routed_scaling_factor=2.0)
  glm_fields = {f.name for f in dataclasses.fields(GlmConfig)}
  for k, v in over.items():
    (fam if k in glm_fields else kw)[k] = v
  return ModelConfig(**kw, family_config=GlmConfig(**fam))


def _logit(p):
  p = np.asarray(p, np.float64)
  return np.log(p / (1 - p)).astype(np.float32)


def test_group_limited_topk_hand_checked():
  """8 experts in 4 groups of 2, keep 2 groups, top-2; worked out by hand.

  sigmoid scores s = [.90 .05 | .60 .55 | .80 .70 | .10 .85]
  bias           b = [0    0  | 0    0  | 0    0  | .40  0 ]
  s + b            = [.90 .05 | .60 .55 | .80 .70 | .50 .85]
  group top-2 sums = [.95, 1.15, 1.50, 1.35] -> keep groups 2 and 3
  (group 0 holds the best single expert, 0, but is dropped; without the bias group 3 would
  sum to .95 and groups 2 and 1 would be kept, giving [4, 5].)
  top-2 of {4:.80, 5:.70, 6:.50, 7:.85} -> [7, 4] (sorted by biased score)
  gates: unbiased s = [.85, .80] / 1.65 * 2.0
  """
  cfg = _cfg()
  s = [.90, .05, .60, .55, .80, .70, .10, .85]
  b = [0, 0, 0, 0, 0, 0, .40, 0]
  out = np.concatenate([_logit(s), np.asarray(b, np.float32)])[None]
  ids, gates, scores = routing.route(cfg, jnp.asarray(out))
  np.testing.assert_array_equal(np.asarray(ids), [[7, 4]])
  np.testing.assert_allclose(np.asarray(gates), [[.85 / 1.65 * 2, .80 / 1.65 * 2]], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(scores), [np.add(s, b)], rtol=1e-5)
  no_bias = np.concatenate([_logit(s), np.zeros(8, np.float32)])[None]
  np.testing.assert_array_equal(np.asarray(routing.route(cfg, jnp.asarray(no_bias))[0]), [[4, 5]])
  np.testing.assert_array_equal(np.asarray(routing.route(cfg, jnp.asarray(no_bias[:, :8]))[0]),
                                [[4, 5]])                  # a bare [.., E] means zero bias
  # Without groups (n_group=1) expert 0 (.90) is selected.
  ids1, _, _ = routing.route(_cfg(n_group=1, topk_group=1, top_k=4), jnp.asarray(out))
  np.testing.assert_array_equal(np.asarray(ids1), [[0, 7, 4, 5]])
  # A larger bias lifts expert 6 (.10 + .65 = .75) over expert 5 (.70); its gate stays unbiased.
  out2 = np.concatenate([_logit(s), np.asarray([0, 0, 0, 0, 0, 0, .65, 0], np.float32)])[None]
  ids2, gates2, _ = routing.route(_cfg(n_group=1, topk_group=1, top_k=4), jnp.asarray(out2))
  np.testing.assert_array_equal(np.asarray(ids2), [[0, 7, 4, 6]])
  np.testing.assert_allclose(np.asarray(gates2), [np.array([.90, .85, .80, .10]) / 2.65 * 2],
                             rtol=1e-5)
  # norm_topk_prob off: raw sigmoids times the scaling factor (sum != 1).
  _, g3, _ = routing.route(_cfg(norm_topk_prob=False), jnp.asarray(out))
  np.testing.assert_allclose(np.asarray(g3), [[.85 * 2, .80 * 2]], rtol=1e-5)


def test_config_hub_spelling_and_errors(tmp_path):
  """GLM-4.5-Air and GLM-4.7-Flash style hub config.json fields (no rope_parameters)."""
  air = {"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
         "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
         "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
         "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
         "intermediate_size": 10944, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
         "attention_bias": True, "use_qk_norm": False, "num_nextn_predict_layers": 1,
         "rms_norm_eps": 1e-5, "eos_token_id": [151329, 151336, 151338]}
  c = ModelConfig.from_hf_dict(air)
  assert (c.num_experts, c.head_dim, c.partial_rotary_factor, c.rope_theta) == (128, 128, .5, 1e6)
  assert c.moe_layers == tuple(range(1, 46)) and c.family_config.num_mtp_layers == 1 and c.attention_bias
  assert c.eos_token_ids == (151329, 151336, 151338)
  hash(c)                                                   # a jit static argument
  flash = {"model_type": "glm4_moe_lite", "vocab_size": 154880, "hidden_size": 2048,
           "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20,
           "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
           "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64,
           "num_experts_per_tok": 4, "moe_intermediate_size": 1536, "intermediate_size": 10240,
           "n_shared_experts": 1, "routed_scaling_factor": 1.8, "rope_theta": 1000000}
  c = ModelConfig.from_hf_dict(flash)                       # 2048 % 20 != 0: no head_dim needed
  assert c.head_dim == 256 and c.moe_layers == tuple(range(1, 47)) and c.family_config.q_lora_rank == 768
  v3 = dict(flash, model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61,
            num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=2048, n_group=8, topk_group=4, first_k_dense_replace=3,
            routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
            rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "beta_fast": 32,
                          "beta_slow": 1})
  c = ModelConfig.from_hf_dict(v3)
  assert c.moe_layers[0] == 3 and (c.family_config.n_group, c.family_config.topk_group) == (8, 4)
  assert dict(c.rope_scaling)["rope_type"] == "yarn" and c.head_dim == 192
  with pytest.raises(ConfigError, match="n_group"):
    ModelConfig.from_hf_dict(dict(air, n_group=3))
  with pytest.raises(ConfigError, match="topk_group"):
    ModelConfig.from_hf_dict(dict(air, n_group=4, topk_group=5))
  with pytest.raises(ConfigError, match="num_key_value_heads"):
    ModelConfig.from_hf_dict(dict(flash, num_key_value_heads=4))
  with pytest.raises(ConfigError, match="rope_scaling"):
    ModelConfig.from_hf_dict(dict(flash, rope_scaling={"type": "yarn", "factor": 4.0}))
  with pytest.raises(ConfigError, match="scoring_func"):
    ModelConfig.from_hf_dict(dict(flash, model_type="deepseek_v3", scoring_func="softmax"))
  with pytest.raises(ConfigError, match="n_routed_experts"):
    ModelConfig.from_hf_dict({k: v for k, v in air.items() if k != "n_routed_experts"})


def test_mtp_layer_tensors_are_ignored(reference, tmp_path):
  """Hub GLM/DeepSeek folders carry a multi-token-prediction layer after the last layer."""
  _only(reference, "glm4_moe")
  src = reference["dirs"]["per_expert"]
  f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  t = {k: np.array(f.get(k)) for k in f.keys()}
  n = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
  for k in list(t):
    if k.startswith("model.layers.1."):
      t[k.replace("model.layers.1.", f"model.layers.{n}.")] = t[k]
  t[f"model.layers.{n}.eh_proj.weight"] = np.zeros((4, 4), np.float32)
  save_file(t, str(tmp_path / "model.safetensors"), {"format": "pt"})
  with open(os.path.join(src, "config.json")) as fi, open(tmp_path / "config.json", "w") as fo:
    fo.write(fi.read())
  cfg, params, store = load_model(str(tmp_path))
  assert f"layers_{n}" not in params and store.moe_layers == (1, 2)
  logits, _, _ = _forward(cfg, params, store.to_device(), [reference["tokens"]])
  np.testing.assert_allclose(np.asarray(logits[0]), reference["pre"], atol=1e-4, rtol=0)


def test_threshold_compares_the_normalised_share_of_sigmoid_gates():
  """Issue 5 part 4 with this family's router: gates sum to routed_scaling_factor, not 1.

  sigmoid scores of the selected [e0 .9, e1 .5, e2 .4, e3 .2] (sum 2.0): shares .45/.25/.2/.1,
  gates = share * 2.5 = 1.125/.625/.5/.25.  Only experts 4 and 5 are resident.  Under
  threshold(0.15) e3 (share .10 < .15, but gate .25 >= .15) is substituted; e1, e2 wait.
  The substitute is ranked by the *biased* score: e4 .06 + .10 bias = .16 beats e5 .07.
  """
  from moejax.cache import policy as policy_lib
  from moejax.cache import resident as resident_lib
  cfg = _cfg(n_group=1, topk_group=1, top_k=4, routed_scaling_factor=2.5)
  s = [.9, .5, .4, .2, .06, .07, .01, .01]
  b = [0, 0, 0, 0, .10, 0, 0, 0]
  out = jnp.asarray(np.concatenate([_logit(s), np.asarray(b, np.float32)])[None])
  st = resident_lib.init_state(cfg.num_experts, 2, {}, buffers=False)
  st = dataclasses.replace(st, slot_expert=jnp.asarray([4, 5], jnp.int32),
                           expert_slot=jnp.asarray([-1, -1, -1, -1, 0, 1, -1, -1], jnp.int32))
  dec = policy_lib.decide(out, st, policy_lib.make_policy("threshold", tau=0.15), cfg)
  np.testing.assert_array_equal(np.asarray(dec.ids), [[0, 1, 2, 3]])
  np.testing.assert_allclose(np.asarray(dec.gates), [[1.125, .625, .5, .25]], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(dec.share), [[.45, .25, .2, .1]], rtol=1e-5)
  F, S = policy_lib.FETCH, policy_lib.SUBSTITUTE
  np.testing.assert_array_equal(np.asarray(dec.action), [[F, F, F, S]])
  np.testing.assert_array_equal(np.asarray(dec.sub_ids), [[-1, -1, -1, 4]])
  # substituted mass as a share of the selected weight: 0.10 (the raw gate would say 0.25)
  mass = float(np.sum(np.where(np.asarray(dec.action) == S, np.asarray(dec.share), 0)))
  assert abs(mass - 0.10) < 1e-6


def test_engine_fetch_all_equals_resident_model(reference):
  """The offload engine at a 25% budget with fetch_all gives the resident model's logits."""
  _only(reference, "deepseek_v3")   # MLA latent cache, group-limited routing, shared experts
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = load_model(reference["dirs"]["fused"])
  toks, gen = reference["tokens"], reference["gen"][:6]
  full, _, _ = _forward(cfg, params, store.to_device(), [toks + gen])
  full = np.asarray(full[0])
  t = len(toks)
  with OffloadEngine(cfg, params, store, EngineConfig.make("fetch_all", cache_fraction=0.25,
                                                           max_len=32)) as eng:
    np.testing.assert_allclose(eng.prefill(toks), full[t - 1], atol=1e-5, rtol=0)
    for i, tok in enumerate(gen):
      np.testing.assert_allclose(eng.decode_step(tok), full[t + i], atol=1e-5, rtol=0)
    st = eng.stats()
    assert st["fetches_per_token"] > 0 and st["substituted_call_pct"] == 0
    assert all(len(s) <= 2 for s in eng.resident_sets().values())


def test_bf16_keeps_router_in_f32_and_runs_close(reference):
  _only(reference, "glm4_moe_lite")
  cfg, params, store = load_model(reference["dirs"]["fused"], dtype=jnp.bfloat16)
  gate = params["layers_1"]["mlp"]["gate"]
  chex.assert_type([gate["weight"], gate["e_score_correction_bias"]], jnp.float32)
  chex.assert_type(params["layers_1"]["self_attn"]["o_proj"]["weight"], jnp.bfloat16)
  logits, _, _ = _forward(cfg, params, store.to_device(), [reference["tokens"]], jnp.bfloat16)
  chex.assert_type(logits, jnp.float32)
  assert np.abs(np.asarray(logits[0]) - reference["pre"]).max() < 0.1


def test_mla_absorbed_equals_expanded_with_causal_mask():
  """The decode-path MLA (kv_b absorbed into q and o) equals expanding keys and values."""
  from moejax.model.families import glm
  r = np.random.default_rng(3)
  h, dn, dr, dv, c, t, s = 4, 8, 6, 12, 16, 5, 9
  f = lambda *shp: jnp.asarray(r.standard_normal(shp).astype(np.float32))
  q_pass, q_rot, kv, krot, w = f(2, t, h, dn), f(2, t, h, dr), f(2, s, c), f(2, s, dr), \
      f(h, dn + dv, c)
  q_pos = jnp.broadcast_to(jnp.arange(2, 2 + t), (2, t))
  k_pos = jnp.broadcast_to(jnp.arange(s), (2, s))
  absorbed = jax.jit(glm._mla_absorbed, static_argnums=(5, 8))
  got = absorbed(q_pass, q_rot, kv, krot, w, dn, q_pos, k_pos, 0.3)

  @jax.jit
  def expanded(q_pass, q_rot, kv, krot, w):
    kvb = jnp.einsum("bsc,hoc->bsho", kv, w)
    keys = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(krot[:, :, None], (2, s, h, dr))], -1)
    return gqa_attention(jnp.concatenate([q_pass, q_rot], -1), keys, kvb[..., dn:], q_pos, k_pos,
                         0.3)
  want = expanded(q_pass, q_rot, kv, krot, w)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  # the mask matters: query 0 (position 2) must not see keys 3..8
  kv2 = kv.at[:, 3:].set(100.0)
  got2 = absorbed(q_pass, q_rot, kv2, krot, w, dn, q_pos, k_pos, 0.3)
  np.testing.assert_allclose(np.asarray(got2[:, 0]), np.asarray(got[:, 0]), atol=1e-5)
  assert np.abs(np.asarray(got2[:, -1]) - np.asarray(got[:, -1])).max() > 1e-2


def test_deepseek_yarn_rope_matches(tmp_path):
  """DeepSeek-V3's YaRN (mscale_all_dim scales the softmax too), at positions 200..211."""
  yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.7,
          "mscale_all_dim": 1.0, "original_max_position_embeddings": 32, "beta_fast": 32,
          "beta_slow": 1}
  model = hf_models.build("deepseek_v3", rope_parameters=yarn)
  with torch.no_grad():  # sharpen attention so the rotary frequencies matter to the logits
    for n, w in model.named_parameters():
      if n.endswith(("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")):
        w.mul_(6.0)
  tokens = [int(t) for t in np.random.default_rng(4).integers(0, 96, 12)]
  pos = np.arange(200, 212)[None]
  with torch.no_grad():
    ref = model(torch.tensor([tokens]), position_ids=torch.tensor(pos)).logits[0].numpy()
  d = hf_models.save(model, str(tmp_path / "yarn"), "fused")
  cfg, params, store = load_model(d)
  assert dict(cfg.rope_scaling)["factor"] == 8.0
  run = lambda c: np.asarray(_forward(c, params, store.to_device(), [tokens], positions=pos)[0][0])
  np.testing.assert_allclose(run(cfg), ref, atol=1e-4, rtol=0)
  assert np.abs(run(dataclasses.replace(cfg, rope_scaling=())) - ref).max() > 1e-2


def test_glm4_moe_variant_qk_norm_unnormalised_gates(tmp_path):
  """Other glm4_moe switches: use_qk_norm, norm_topk_prob=False, one group, two shared experts."""
  model = hf_models.build("glm4_moe", use_qk_norm=True, norm_topk_prob=False, n_group=1,
                          topk_group=1, n_shared_experts=2, attention_bias=False)
  tokens = [int(t) for t in np.random.default_rng(5).integers(0, 96, 12)]
  with torch.no_grad():
    ref = model(torch.tensor([tokens])).logits[0].numpy()
  cfg, params, store = load_model(hf_models.save(model, str(tmp_path / "v"), "per_expert"))
  assert cfg.qk_norm == "head" and not cfg.norm_topk_prob and cfg.family_config.n_shared_experts == 2
  logits, _, _ = _forward(cfg, params, store.to_device(), [tokens])
  np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-4, rtol=0)
