"""Tiny random transformers models for parity tests (eager attention and experts)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from moejax.model.sampler import Sampler, SamplingParams

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, max_position_embeddings=256)


def build(family: str, seed: int = 0, **over):
  """A tiny transformers model of `family` with random weights, in f32, eval mode."""
  torch.manual_seed(seed)
  kw = dict(TINY)
  if family == "qwen3_moe":
    kw.update(num_experts=8, moe_intermediate_size=16, intermediate_size=48,
              norm_topk_prob=True, mlp_only_layers=[1], rope_theta=10000.0)
    kw.update(over)
    cfg = transformers.Qwen3MoeConfig(**kw)
    cls = transformers.Qwen3MoeForCausalLM
  elif family == "mixtral":
    kw.update(num_local_experts=8, intermediate_size=16)
    kw.update(over)
    cfg = transformers.MixtralConfig(**kw)
    cls = transformers.MixtralForCausalLM
  elif family == "olmoe":
    kw.update(num_experts=8, intermediate_size=16, norm_topk_prob=False, clip_qkv=None)
    kw.update(over)
    kw.pop("head_dim")
    cfg = transformers.OlmoeConfig(**kw)
    cls = transformers.OlmoeForCausalLM
  elif family == "qwen3_next":
    # 4 layers: DeltaNet x3 + gated full attention; layer 1 dense; 2 key / 4 value DeltaNet heads.
    kw.update(num_hidden_layers=4, head_dim=16, num_experts=8, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, intermediate_size=48, norm_topk_prob=True,
              mlp_only_layers=[1], linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    kw.update(over)
    cfg = transformers.Qwen3NextConfig(**kw)
    cls = transformers.Qwen3NextForCausalLM
  elif family in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):
    # sigmoid routers with correction bias; glm4_moe: 2 groups keep 1, partial RoPE, q/k/v bias;
    # deepseek_v3: 4 groups keep 2, no q LoRA, plain RoPE; glm4_moe_lite: MLA, interleaved RoPE.
    kw.update(n_routed_experts=8, moe_intermediate_size=16, intermediate_size=48,
              n_shared_experts=1, norm_topk_prob=True)
    if family == "glm4_moe":
      kw.update(n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                attention_bias=True, use_qk_norm=False)
      cls, ccls = transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig
    else:
      kw.pop("head_dim")
      kw.update(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=12)
      if family == "deepseek_v3":
        kw.update(q_lora_rank=None, n_group=4, topk_group=2, first_k_dense_replace=1,
                  rope_interleave=False, routed_scaling_factor=2.5)
        cls, ccls = transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config
      else:
        kw.update(q_lora_rank=24, mlp_layer_types=["dense", "sparse", "sparse"],
                  rope_interleave=True, routed_scaling_factor=1.8)
        cls, ccls = transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig
    kw.update(over)
    cfg = ccls(**kw)
  elif family == "gpt_oss":
    # 3 layers sliding / full / sliding with a window of 4 (prompts are longer); default YaRN;
    # expert sizes multiples of 32 so the same weights also have an MXFP4 form.
    kw.pop("num_experts_per_tok")
    kw.update(num_local_experts=16, num_experts_per_tok=4, intermediate_size=32, sliding_window=4)
    kw.update(over)
    cfg = transformers.GptOssConfig(**kw)
    cls = transformers.GptOssForCausalLM
  else:
    raise ValueError(family)
  cfg._attn_implementation = "eager"
  try:
    cfg._experts_implementation = "eager"
  except Exception:  # older transformers
    pass
  model = cls(cfg).float().eval()
  # Random init gives tiny weights; widen the router and norms so routing is not uniform.
  with torch.no_grad():
    for n, p in model.named_parameters():
      if n.endswith("mlp.gate.weight") or n.endswith("block_sparse_moe.gate.weight"):
        p.normal_(0, 0.5)
      elif "norm" in n:
        p.uniform_(0.5, 1.5)
        if family == "qwen3_next" and not n.endswith("linear_attn.norm.weight"):
          p.sub_(1.0)  # zero-centred norms apply (1 + w)
      elif n.endswith("shared_expert_gate.weight"):
        p.normal_(0, 0.5)
      elif family == "qwen3_next" and any(f".{m}." in n for m in (
          "in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert", "self_attn", "experts")):
        p.normal_(0, 0.15)  # make every mixer and expert matter in the logits
      elif n.endswith("mlp.router.weight") or n.endswith("mlp.router.bias"):
        p.normal_(0, 0.5)                   # gpt_oss router
      elif n.endswith("self_attn.sinks"):
        p.normal_(0, 1.0)                   # gpt_oss: sinks that take real attention mass
      elif n.endswith("experts.gate_up_proj_bias"):
        p.normal_(0, 4.0)                   # gpt_oss: drive gate/up past the +-7 clamp
    for n, b in model.named_buffers():
      if n.endswith("e_score_correction_bias"):  # zero at init; make it change the selection
        b.normal_(0, 0.2)
  return model


def save(model, out_dir: str, layout: str):
  """layout: 'per_expert' (hub format) or 'fused' (transformers v5 in-memory format)."""
  os.makedirs(out_dir, exist_ok=True)
  if layout == "fused":
    model.save_pretrained(out_dir, save_original_format=False)
  else:
    model.save_pretrained(out_dir)
  return out_dir


@torch.no_grad()
def reference(model, tokens, steps: int):
  """Prefill logits on `tokens` [1, T] then `steps` greedy cached decode steps.

  Returns (prefill_logits [T, V], decode_logits [steps, V], generated ids [steps]).
  """
  ids = torch.tensor(tokens)[None]
  out = model(ids, use_cache=True)
  pre = out.logits[0].float().numpy()
  past = out.past_key_values
  nxt = out.logits[:, -1].argmax(-1, keepdim=True)
  dec, gen = [], []
  for _ in range(steps):
    gen.append(int(nxt[0, 0]))
    out = model(nxt, past_key_values=past, use_cache=True)
    past = out.past_key_values
    dec.append(out.logits[0, -1].float().numpy())
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
  return pre, dec, gen


def reference_fixture(families):
  """A module-scoped pytest fixture `reference`: `reference_case` of each of `families`."""
  @pytest.fixture(scope="module", params=families)
  def reference(request, tmp_path_factory):
    return reference_case(request.param, tmp_path_factory)
  return reference


def reference_case(family: str, tmp_path_factory, steps: int = 32, tag: str | None = None,
                   model=None) -> dict:
  """A tiny random `family` model (or `model`), its transformers reference on 12 prompt
  tokens (`reference`), and the model saved in both expert layouts (dirs[layout])."""
  model = build(family) if model is None else model
  tokens = [int(t) for t in np.random.default_rng(1).integers(0, 96, 12)]
  pre, dec, gen = reference(model, tokens, steps)
  dirs = {lay: save(model, str(tmp_path_factory.mktemp(f"{tag or family}_{lay}")), lay)
          for lay in ("per_expert", "fused")}
  return dict(family=family, model=model, tokens=tokens, pre=pre, dec=dec, gen=gen, dirs=dirs)


def assert_cached_decode_and_greedy_match(cfg, params, store, ref: dict, steps: int = 32):
  """moejax's Sampler: prefill, then `steps` cached decode steps fed transformers' greedy
  ids, each step's logits within 1e-4 of transformers'; greedy generation gives its ids."""
  s = Sampler(cfg, params, store.to_device(), max_len=64)
  toks, gen = ref["tokens"], ref["gen"]
  _, cache = s.prefill(np.array([toks]))
  for i in range(steps):
    _, lg, cache = s.decode_step(cache, jnp.array([gen[i]]), len(toks) + i, SamplingParams(),
                                 jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(lg[0]), ref["dec"][i], atol=1e-4, rtol=0)
  assert s.generate(toks, SamplingParams(max_new_tokens=steps)) == gen
