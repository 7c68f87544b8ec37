"""Measurements the caller makes before building an engine, one layer's experts at a time.

  layer_compute_seconds  one MoE layer's decode compute here, the denominator of the
                         scaled link's ratio (see moejax.offload.link)
  calibrated_link        a Link for a --link spec (a scaled one measures the above)
  profile_counts         how often each expert is routed on a token stream (the
                         input of ``OffloadEngine(initial="profile")``)

None of them puts more than one layer's experts on the device: each layer runs
with its own expert buffers, copied for the call and released after it (on the CPU
backend read in place from the store), and the
jitted layer function takes them as arguments (nothing is cached but the module).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.model.model import DecoderLayer, Transformer, init_cache
from moejax.io.store import owned_device_put
from moejax.offload import link as link_lib


@functools.lru_cache(maxsize=None)
def _layer_forward(cfg: ModelConfig, dtype, kind: tuple, layer_idx: int):
  mod = DecoderLayer(cfg, bool(cfg.sparse_layers[layer_idx]), dtype, layer_idx)
  del kind  # the cache key: layers of one kind share the compiled function
  return jax.jit(lambda p, x, pos, kv, end, experts: mod.apply({"params": p}, x, pos, kv, end,
                                                              experts))


def layer_kind(cfg: ModelConfig, i: int) -> tuple[bool, str]:
  """Layers of one kind share their compiled forward."""
  return bool(cfg.sparse_layers[i]), (cfg.layer_types[i] if cfg.layer_types else "")


def _embed(cfg: ModelConfig, dtype, params, tokens):
  return Transformer(cfg, dtype).apply({"params": params}, tokens, method="embed")


def _layer_fn(cfg: ModelConfig, dtype, i: int):
  kind = layer_kind(cfg, i)
  first = next(j for j in range(cfg.num_layers) if layer_kind(cfg, j) == kind)
  return _layer_forward(cfg, dtype, kind, first)


def layer_experts(store, layer: int, dtype, device=None) -> dict[str, jax.Array]:
  """Layer `layer`'s experts [E, ...] on the device, read-only (floating ones cast to
  dtype).  On the CPU backend a store already in dtype is read in place (a mapped store:
  the file's pages, no 1.2 GB copy of a Qwen3-30B-A3B layer); elsewhere they are copied."""
  device = device or jax.devices()[0]
  sh = jax.sharding.SingleDeviceSharding(device)
  out = {}
  for k, v in store.stacked(layer).items():
    v = np.asarray(v)
    if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != jnp.dtype(dtype):
      v = v.astype(jnp.dtype(dtype))
    out[k] = jax.device_put(v, sh) if device.platform == "cpu" else owned_device_put(v, sh)
  return out


@functools.lru_cache(maxsize=None)
def _repeated_layer(cfg: ModelConfig, dtype, layer_idx: int):
  """One jitted call applying layer `layer_idx` num_layers times (one layer's experts:
  the compute of a whole decode step's layers, without a copy of every layer)."""
  mod = DecoderLayer(cfg, True, dtype, layer_idx)

  def run(p, x, pos, kv, end, experts):
    def body(_, carry):
      x, kv = carry
      x, kv, _ = mod.apply({"params": p}, x, pos, kv, end, experts)
      return x, kv
    return jax.lax.fori_loop(0, cfg.num_layers, body, (x, kv))

  return jax.jit(run)


def layer_compute_seconds(cfg: ModelConfig, params, store, dtype=jnp.float32,
                          steps: int = 20) -> float:
  """One MoE layer's decode compute time on this machine, its experts resident.

  The first MoE layer's decode step (attention, router, its selected experts) at
  batch 1, applied num_layers times in one jitted call with that layer's own expert
  buffers, divided by num_layers; the 25th percentile of `steps` timed calls (on a
  shared machine the slow calls measure the other processes).
  """
  l = cfg.moe_layers[0]
  fn = _repeated_layer(cfg, dtype, l)
  p = params[f"layers_{l}"]
  experts = layer_experts(store, l, dtype)
  max_len = steps + 8
  kv = init_cache(cfg, 1, max_len, dtype)[l]
  x = _embed(cfg, dtype, params, jnp.zeros((1, 1), jnp.int32))
  times = []
  for i in range(steps + 3):
    pos, end = jnp.full((1, 1), i, jnp.int32), jnp.int32(i)
    t0 = time.perf_counter()
    y, kv = fn(p, x, pos, kv, end, experts)
    y.block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(np.percentile(times[3:], 25)) / cfg.num_layers


def calibrated_link(spec, cfg: ModelConfig, params, store, dtype=jnp.float32) -> link_lib.Link:
  """A Link from a Link or a --link spec; a scaled spec measures `layer_compute_seconds`."""
  if isinstance(spec, link_lib.Link):
    return spec
  if isinstance(spec, str) and spec.strip().lower().startswith("scaled"):
    return link_lib.parse_link(spec, expert_bytes=store.expert_nbytes(),
                               layer_compute_s=layer_compute_seconds(cfg, params, store, dtype))
  return link_lib.parse_link(spec, expert_bytes=store.expert_nbytes())


def profile_counts(cfg: ModelConfig, params, store, tokens, dtype=jnp.float32) -> dict:
  """Per MoE layer, how often each expert is routed on `tokens` (teacher-forced, every
  expert of the running layer resident): {layer: counts [E]}."""
  toks = jnp.asarray([list(tokens)], jnp.int32)
  t = toks.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  x = _embed(cfg, dtype, params, toks)
  kv_all = init_cache(cfg, 1, t, dtype)
  out = {}
  for i in range(cfg.num_layers):
    experts = layer_experts(store, i, dtype) if cfg.sparse_layers[i] else None
    x, _, logits = _layer_fn(cfg, dtype, i)(params[f"layers_{i}"], x, pos, kv_all[i],
                                            jnp.int32(0), experts)
    if cfg.sparse_layers[i]:
      ids = routing.route(cfg, logits.reshape(-1, logits.shape[-1])).ids
      out[i] = np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)
    del experts
  return out
