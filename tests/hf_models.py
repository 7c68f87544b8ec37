"""Tiny random transformers models for parity tests (eager attention and experts)."""

from __future__ import annotations

import os

import torch
import transformers

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
