"""The pure-functional Flax MoE transformer (qwen3_moe, mixtral, olmoe).

Parameter names follow Hugging Face (``layers_3/self_attn/q_proj/weight`` is
``model.layers.3.self_attn.q_proj.weight``), with ``weight`` as [out, in].
Routed experts are *not* parameters: every call takes them explicitly, one
``{"gate_up": [E, 2I, D], "down": [E, D, I]}`` dict per layer (None for dense
layers), so the offload engine can hand in slot buffers instead.

A decoder layer is exposed in two halves so an engine can decide between them:
  (a) ``attend`` + ``route_logits``: attention with its residual, then the
      pre-MoE norm and the router logits;
  (b) ``moe_residual``: the routed experts (and residual) from given ids/gates.

The KV cache is an explicit pytree: a list over layers of {"k", "v"} arrays of
static shape [B, S, kv_heads, head_dim]; ``end_index`` is the number of
positions already written.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax import experts as experts_lib
from moejax import routing
from moejax.config import ModelConfig
from moejax.families import glm
from moejax.families import gpt_oss
from moejax.families import qwen3_next
from moejax.layers import (Linear, RMSNorm, SwiGLU, apply_rope, cached_attention, project_qkv,
                           rope_cos_sin)

Cache = list  # list over layers of {"k": [B,S,Hkv,K], "v": [B,S,Hkv,K]}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> Cache:
  if cfg.router == "sigmoid_group":  # glm4_moe / MLA latent caches
    return glm.init_cache(cfg, batch, max_len, dtype)
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return [qwen3_next.init_linear_cache(cfg, batch, dtype) if qwen3_next.is_linear_layer(cfg, i)
          else {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
          for i in range(cfg.num_layers)]


def _norm(c: ModelConfig, dtype):
  """The family's RMSNorm: zero-centred (x * (1 + w)) for qwen3_next, else x * w."""
  return (qwen3_next.ZeroCentredRMSNorm if c.zero_centred_norm else RMSNorm)(c.rms_norm_eps, dtype)


class Attention(nn.Module):
  cfg: ModelConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, cache, end_index):
    c = self.cfg
    q, k, v = project_qkv(c, x_BxTxD, self.dtype)
    cos, sin = rope_cos_sin(positions_BxT, c.head_dim, c.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, cache = cached_attention(q, k, v, positions_BxT, cache, end_index)
    return Linear(c.hidden_size, use_bias=c.attention_bias, dtype=self.dtype,
                  name="o_proj")(o), cache


class Router(nn.Module):
  cfg: ModelConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    return Linear(self.cfg.num_experts, dtype=self.dtype, name="gate")(x)


class DecoderLayer(nn.Module):
  """One decoder layer; ``sparse`` selects routed experts vs a dense MLP."""
  cfg: ModelConfig
  sparse: bool
  dtype: Any = jnp.float32
  layer_idx: int = 0

  def setup(self):
    c = self.cfg
    self.input_layernorm = _norm(c, self.dtype)
    if qwen3_next.is_linear_layer(c, self.layer_idx):
      self.linear_attn = qwen3_next.GatedDeltaNet(c, self.dtype)
    elif c.attn_output_gate:
      self.self_attn = qwen3_next.GatedAttention(c, self.dtype)
    elif c.model_type == "gpt_oss":  # sinks, biases, YaRN; "sliding_attention" layers windowed
      self.self_attn = gpt_oss.Attention(
          c, c.layer_types[self.layer_idx] == "sliding_attention", self.dtype)
    elif c.router == "sigmoid_group":  # glm4_moe partial-RoPE GQA, or MLA
      self.self_attn = glm.attention(c, self.dtype)
    else:
      self.self_attn = Attention(c, self.dtype)
    self.post_attention_layernorm = _norm(c, self.dtype)
    if not self.sparse:
      self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, self.dtype)
    elif c.model_type == "qwen3_next":
      self.mlp = qwen3_next.SparseMoeBlock(c, self.dtype)
    elif c.model_type == "gpt_oss":
      self.mlp = gpt_oss.Router(c, self.dtype)           # mlp.router.{weight,bias}
    elif c.router == "sigmoid_group":
      self.mlp = glm.SigmoidMoE(c, self.dtype)           # mlp.gate + mlp.shared_experts
    else:
      self.mlp = Router(c, self.dtype)

  def attend(self, x_BxTxD, positions_BxT, cache, end_index):
    """(a1) h = x + attn(norm(x)); returns (h, new_cache)."""
    mixer = (self.linear_attn if qwen3_next.is_linear_layer(self.cfg, self.layer_idx)
             else self.self_attn)
    a, cache = mixer(self.input_layernorm(x_BxTxD), positions_BxT, cache, end_index)
    return x_BxTxD + a, cache

  def route_logits(self, h_BxTxD):
    """(a2) the pre-MoE normed input and the router logits [B,T,E] (sparse layers)."""
    moe_in = self.post_attention_layernorm(h_BxTxD)
    return moe_in, self.mlp(moe_in)

  def dense_residual(self, h_BxTxD):
    return h_BxTxD + self.mlp(self.post_attention_layernorm(h_BxTxD))

  def __call__(self, x_BxTxD, positions_BxT, cache, end_index, expert_weights):
    h, cache = self.attend(x_BxTxD, positions_BxT, cache, end_index)
    if not self.sparse:
      return self.dense_residual(h), cache, None
    moe_in, logits = self.route_logits(h)
    ids, gates, _ = routing.route(self.cfg, logits)
    return self.moe_residual(h, moe_in, ids, gates, expert_weights), cache, logits

  def moe_residual(self, h_BxTxD, moe_in_BxTxD, ids_BxTxK, gates_BxTxK, expert_weights):
    """(b) h + sum_k g_k * expert_k(moe_in); ids index into `expert_weights` (table or slots).

    Families with shared experts add them here (they are dense, resident parameters).
    """
    b, t, d = h_BxTxD.shape
    y = experts_lib.apply_experts(moe_in_BxTxD.reshape(b * t, d), ids_BxTxK.reshape(b * t, -1),
                                  gates_BxTxK.reshape(b * t, -1), expert_weights,
                                  swiglu=(self.cfg.swiglu_alpha, self.cfg.swiglu_limit))
    y = y.reshape(b, t, d).astype(h_BxTxD.dtype)
    if self.cfg.shared_expert_intermediate_size and hasattr(self.mlp, "shared_output"):
      y = y + self.mlp.shared_output(moe_in_BxTxD)        # qwen3_next: sigmoid-gated
    if self.cfg.n_shared_experts and hasattr(self.mlp, "shared"):
      y = y + self.mlp.shared(moe_in_BxTxD)               # glm / deepseek: ungated
    return h_BxTxD + y


class Transformer(nn.Module):
  cfg: ModelConfig
  dtype: Any = jnp.float32

  def setup(self):
    c = self.cfg
    self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=self.dtype,
                                 dtype=self.dtype, embedding_init=nn.initializers.normal(0.02))
    self.layers = [DecoderLayer(c, s, self.dtype, i) for i, s in enumerate(c.sparse_layers)]
    self.norm = _norm(c, self.dtype)
    if not c.tie_word_embeddings:
      self.lm_head = Linear(c.vocab_size, dtype=self.dtype)

  def embed(self, tokens_BxT):
    return self.embed_tokens(tokens_BxT)

  def logits(self, x_BxTxD):
    x = self.norm(x_BxTxD)
    if self.cfg.tie_word_embeddings:
      return self.embed_tokens.attend(x).astype(jnp.float32)
    return self.lm_head(x).astype(jnp.float32)

  def __call__(self, tokens_BxT, expert_weights, cache=None, end_index=0, positions_BxT=None):
    """Full forward. Returns (logits [B,T,V] f32, new cache, router logits per layer)."""
    x, new_cache, router_logits = self.hidden(tokens_BxT, expert_weights, cache, end_index,
                                              positions_BxT)
    return self.logits(x), new_cache, router_logits

  def hidden(self, tokens_BxT, expert_weights, cache=None, end_index=0, positions_BxT=None):
    """The forward before the final norm and LM head: (x [B,T,D], new cache, router logits)."""
    b, t = tokens_BxT.shape
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(end_index + jnp.arange(t), (b, t))
    x = self.embed(tokens_BxT)
    new_cache, router_logits = [], []
    for i, layer in enumerate(self.layers):
      x, ci, rl = layer(x, positions_BxT, None if cache is None else cache[i], end_index,
                        expert_weights[i])
      new_cache.append(ci)
      router_logits.append(rl)
    return x, (None if cache is None else new_cache), router_logits
