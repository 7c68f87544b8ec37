"""The pure-functional Flax MoE transformer of every family (``moejax.model.families``).

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
positions already written: one for the batch, or [B], each sequence at its own position
(a batch of sequences decoded together, joining and leaving at token boundaries).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.kernels import cpu_rows
from moejax.model import experts as experts_lib
from moejax.model import families
from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.ggml.qarray import QuantArray
from moejax.model.layers import Embed, Linear, SwiGLU

Cache = list  # list over layers of {"k": [B,S,Hkv,K], "v": [B,S,Hkv,K]}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> Cache:
  """An empty KV cache (and recurrent state), made by one compiled program: eagerly its
  2L zero arrays were 2L dispatches, 8.8 ms of a 12-token demo prompt's 9.4 ms."""
  return _empty_cache(cfg, batch, max_len, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> Cache:
  return families.of(cfg).init_cache(cfg, batch, max_len, dtype)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
def put_row(cache_B: Cache, cache_1: Cache, row, axis: int = 0) -> Cache:
  """A batch-1 cache (a sequence's prompt pass) written into row `row` of a batch's cache,
  which is donated: a sequence joins a batch decoded together.  cache_1 may be shorter
  than the batch's (a prompt pass sized to its bucket): it fills the row's first
  positions, and the rest, never read before the row's decode writes them, is left.
  axis: the row axis (1: a scanned program's caches stacked [L, B, ...])."""
  def one(c, r):
    start = [0] * c.ndim
    start[axis] = row
    return jax.lax.dynamic_update_slice(c, r.astype(c.dtype), start)
  return jax.tree_util.tree_map(one, cache_B, cache_1)


class DecoderLayer(nn.Module):
  """One decoder layer; ``sparse`` selects routed experts vs a dense MLP."""
  cfg: ModelConfig
  sparse: bool
  dtype: Any = jnp.float32
  layer_idx: int = 0

  def setup(self):
    c = self.cfg
    family = families.of(c)
    self.input_layernorm = family.norm(c, self.dtype)
    # named like the hub tensors: self_attn (attention) or linear_attn (Gated DeltaNet)
    setattr(self, family.mixer_name(c, self.layer_idx), family.mixer(c, self.layer_idx, self.dtype))
    self.post_attention_layernorm = family.norm(c, self.dtype)
    if self.sparse:
      self.mlp = family.sparse_mlp(c, self.dtype)
    else:
      self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, self.dtype)

  def attend(self, x_BxTxD, positions_BxT, cache, end_index):
    """(a1) h = x + mixer(norm(x)); returns (h, new_cache)."""
    mixer = getattr(self, families.of(self.cfg).mixer_name(self.cfg, self.layer_idx))
    a, cache = mixer(self.input_layernorm(x_BxTxD), positions_BxT, cache, end_index)
    return x_BxTxD + a, cache

  def route_logits(self, h_BxTxD):
    """(a2) the pre-MoE normed input and the router logits [B,T,E] (sparse layers)."""
    moe_in = self.post_attention_layernorm(h_BxTxD)
    return moe_in, self.mlp(moe_in)

  def dense_residual(self, h_BxTxD):
    return h_BxTxD + self.mlp(self.post_attention_layernorm(h_BxTxD))

  def __call__(self, x_BxTxD, positions_BxT, cache, end_index, expert_weights, valid_BxT=None):
    h, cache = self.attend(x_BxTxD, positions_BxT, cache, end_index)
    if not self.sparse:
      return self.dense_residual(h), cache, None
    moe_in, logits = self.route_logits(h)
    ids, gates, _ = routing.route(self.cfg, logits)
    if valid_BxT is not None:   # a prompt's padding goes to no expert (`Transformer.hidden`)
      gates = gates * valid_BxT[..., None].astype(gates.dtype)
    return self.moe_residual(h, moe_in, ids, gates, expert_weights), cache, logits

  def moe_residual(self, h_BxTxD, moe_in_BxTxD, ids_BxTxK, gates_BxTxK, expert_weights):
    """(b) h + sum_k g_k * expert_k(moe_in); ids index into `expert_weights` (table or slots).

    Families with shared experts add them here (the ``mlp``'s ``shared_output``: dense,
    resident parameters).
    """
    b, t, d = h_BxTxD.shape
    y = experts_lib.apply_experts(moe_in_BxTxD.reshape(b * t, d), ids_BxTxK.reshape(b * t, -1),
                                  gates_BxTxK.reshape(b * t, -1), expert_weights,
                                  swiglu=families.of(self.cfg).swiglu(self.cfg))
    return self.add_routed(h_BxTxD, moe_in_BxTxD, y.reshape(b, t, d))

  def add_routed(self, h_BxTxD, moe_in_BxTxD, y_BxTxD):
    """h + y (+ the shared experts) for routed experts' output y computed by the caller
    (the expert-parallel engine: a psum over the devices' slots)."""
    y = y_BxTxD.astype(h_BxTxD.dtype)
    if hasattr(self.mlp, "shared_output"):
      y = y + self.mlp.shared_output(moe_in_BxTxD)
    return h_BxTxD + y


def _take_bf16_as_u16(table_VxD, tokens_BxT):
  # XLA's CPU backend gathers bf16 in f32 (a convert of the table in the fusion, ~0.1 ms a
  # decode step on the demo model): the same bits as uint16.  Out-of-range ids give NaN.
  u16 = jax.lax.bitcast_convert_type(table_VxD, jnp.uint16)
  return jax.lax.bitcast_convert_type(jnp.take(u16, tokens_BxT, axis=0), jnp.bfloat16)


class Transformer(nn.Module):
  cfg: ModelConfig
  dtype: Any = jnp.float32

  def setup(self):
    c = self.cfg
    self.embed_tokens = Embed(c.vocab_size, c.hidden_size, self.dtype)
    self.layers = [DecoderLayer(c, s, self.dtype, i) for i, s in enumerate(c.sparse_layers)]
    self.norm = families.of(c).norm(c, self.dtype)
    if not c.tie_word_embeddings:
      self.lm_head = Linear(c.vocab_size, dtype=self.dtype)

  def embed(self, tokens_BxT):
    table = self.embed_tokens.embedding
    if table.dtype == jnp.bfloat16 and not isinstance(table, QuantArray):   # a kernel call on CPU (cpu_rows.take_rows)
      return cpu_rows.take_rows(table, tokens_BxT, _take_bf16_as_u16)
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

  def hidden(self, tokens_BxT, expert_weights, cache=None, end_index=0, positions_BxT=None,
             valid_BxT=None):
    """The forward before the final norm and LM head: (x [B,T,D], new cache, router logits).
    valid_BxT: a padded prompt's own tokens; the others (its bucket's padding) go to no
    expert: the expert kernels skip a pair whose gate is 0, and no position reads a later
    one, so the valid positions keep their bits."""
    b, t = tokens_BxT.shape
    if positions_BxT is None:   # end_index: a scalar, or [B] (each row at its own position)
      positions_BxT = jnp.broadcast_to(jnp.reshape(end_index, (-1, 1)) + jnp.arange(t), (b, t))
    x = self.embed(tokens_BxT)
    new_cache, router_logits = [], []
    for i, layer in enumerate(self.layers):
      x, ci, rl = layer(x, positions_BxT, None if cache is None else cache[i], end_index,
                        expert_weights[i], valid_BxT)
      new_cache.append(ci)
      router_logits.append(rl)
    return x, (None if cache is None else new_cache), router_logits


def abstract_experts(cfg: ModelConfig, dtype=jnp.float32) -> list:
  """Per layer: the routed experts' {kind: ShapeDtypeStruct [E, ...]} (None: a dense layer)."""
  shp = families.of(cfg).expert_shapes(cfg)
  return [({k: jax.ShapeDtypeStruct((cfg.num_experts,) + v, dtype) for k, v in shp.items()}
           if s else None) for s in cfg.sparse_layers]


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
  """The Transformer's parameter tree as ShapeDtypeStructs (nothing is allocated): what a
  checkpoint must hold, leaf by leaf."""
  model = Transformer(cfg, dtype)
  toks = jnp.zeros((1, 2), jnp.int32)
  return jax.eval_shape(lambda e: model.init(jax.random.PRNGKey(0), toks, e),
                        abstract_experts(cfg, dtype))["params"]


def nest_params(leaves: dict) -> dict:
  """{path tuple: leaf} (the flat form a checkpoint reader fills) -> the nested param tree."""
  params: dict[str, Any] = {}
  for p, v in leaves.items():
    d = params
    for k in p[:-1]:
      d = d.setdefault(k, {})
    d[p[-1]] = v
  return params
