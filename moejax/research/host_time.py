"""A HOST miss's expert compute, timed: the engine's HOST branch (`sources.host_experts`)
on one token, jitted on the CPU device, over a store of SwiGLU experts held as the engine
holds them (bf16 as uint16 bits).

What `moejax-host-ms` measures for `generate --policy=cost --host_ms=FILE`, and the
moejax side of the checkout's llama.cpp comparison (launch/bench_host.py).  Call i
uses experts (i*K .. i*K+K-1) mod E: a store larger than the last-level cache makes
every call read its weights from memory, as a decode step does.
"""

from __future__ import annotations

import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel
from moejax.model.config import ModelConfig
from moejax.offload import sources


def qwen3_like(d: int, inter: int, experts: int, k: int) -> ModelConfig:
  """A one-layer qwen3_moe config of hidden size d, expert width inter, top-k."""
  return ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=d, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=16, num_experts=experts,
                     top_k=k, moe_intermediate_size=inter, intermediate_size=4 * inter,
                     sparse_layers=(True,), qk_norm="head").validate()


def make_store(d: int, inter: int, experts: int, seed: int = 0) -> dict:
  """The engine's program store of one layer: bf16 experts as their uint16 bits."""
  rng = np.random.default_rng(seed)
  bits = lambda shape: jnp.asarray((rng.standard_normal(shape, np.float32) * 0.02)
                                   .astype(jnp.bfloat16).view(np.uint16))
  return {"gate_up": bits((experts, 2 * inter, d)), "down": bits((experts, d, inter))}


def host_fn(cfg: ModelConfig, in_place: bool):
  """The HOST branch's expert call, jitted on the CPU device (in_place=False: each expert
  sliced out of the store, then the routed-expert kernel)."""
  ctx = types.SimpleNamespace(pinned=False, cfg=cfg)
  dtypes = {"gate_up": jnp.bfloat16, "down": jnp.bfloat16}
  return jax.jit(lambda store, x, ids, gates: sources.host_experts(
      ctx, store, dtypes, x, ids, gates, in_place=in_place))


def time_calls(fn, store, x, k: int, experts: int, iters: int) -> float:
  """Median seconds per call of `fn` on K experts (after a warm-up over every expert)."""
  ids = [jnp.asarray([(i * k + j) % experts for j in range(k)], jnp.int32)
         for i in range(experts)]
  gates = jnp.full((k,), 1.0 / k, jnp.float32)
  times = []
  with cpu_kernel.decoding():
    for i in range(experts + iters):
      t0 = time.perf_counter()
      fn(store, x, ids[i % experts], gates).block_until_ready()
      times.append(time.perf_counter() - t0)
  return statistics.median(times[experts:])


def host_ms(d: int, inter: int, experts: int = 16, iters: int = 50, rounds: int = 3,
            seed: int = 0) -> dict:
  """One expert's HOST call in ms at width (d, inter): the median over `rounds` of the
  median of `iters` calls; {"host_ms", "rounds_ms", "cpu_kernel"}."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    store = make_store(d, inter, experts, seed)
    x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(d), jnp.bfloat16)
    fn = host_fn(qwen3_like(d, inter, experts, 1), True)
    per = [1e3 * time_calls(fn, store, x, 1, experts, iters) for _ in range(rounds)]
  return {"host_ms": statistics.median(per), "rounds_ms": per,
          "cpu_kernel": cpu_kernel.available()}
