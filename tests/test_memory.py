"""moejax.offload.memory: the bytes printed before loading, against hand counts and a loaded model."""

import os

import jax.numpy as jnp

from moejax.offload import memory
from moejax.model.config import ModelConfig

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")


def tiny():
  return ModelConfig(model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4, num_experts=8, top_k=2,
                     moe_intermediate_size=4, intermediate_size=16, sparse_layers=(True, True),
                     qk_norm="head").validate()


def test_plan_by_hand():
  p = memory.plan_memory(tiny(), jnp.float32, store="numpy", cache_fraction=0.25, kv_len=10)
  assert p.expert_bytes == 3 * 8 * 4 * 4                    # gate, up, down of 8 x 4, f32
  # S = round(0.25 * 8) = 2 slots, no staging (K = 2 <= S), + 1 scratch row
  assert p.cache_slots == 3 and p.expert_cache_bytes == 3 * 384 * 2
  assert p.kv_bytes == 2 * 2 * 10 * 1 * 4 * 4               # layers x (k, v) x len x kv x hd
  per_layer = (8 * 8 + 2 * 8 * 4 + 8 * 8    # q [8, 2x4], k and v [8, 4], o [8, 8]
               + 4 + 4 + 8 + 8              # q/k norms, the two layer norms
               + 8 * 8)                     # router [E, D]
  assert p.dense_bytes == 4 * (2 * 16 * 8 + 2 * per_layer + 8)   # embed + head, final norm
  assert p.prefill_bytes == 0                               # CPU: the store read in place
  gpu = memory.plan_memory(tiny(), jnp.float32, cache_fraction=0.25, kv_len=10, platform="gpu")
  assert gpu.prefill_bytes == 8 * 384                       # one layer, for the prompt pass
  assert p.host_bytes == 2 * 8 * 384
  assert p.stacked_bytes == 4 * 2 * per_layer   # the scanned engine's copy of both layers
  assert p.device_bytes == (p.dense_bytes + p.stacked_bytes + p.expert_cache_bytes + p.kv_bytes
                            + p.prefill_bytes)
  # the tiers: on the CPU the device's bytes are anonymous RAM beside the numpy store
  assert p.anon_bytes == p.host_bytes + p.device_bytes and p.page_cache_bytes == 0
  assert gpu.anon_bytes == gpu.host_bytes
  mm = memory.plan_memory(tiny(), jnp.float32, store="mmap", kv_len=10)
  assert mm.host_bytes == 0 and mm.page_cache_bytes == 2 * 8 * 384
  assert mm.anon_bytes == mm.device_bytes
  assert any(line.startswith("page cache") for line in mm.lines())
  # no policy on the CPU: the experts are read where the store holds them (counted once)
  res = memory.plan_memory(tiny(), jnp.float32, store="mmap", offload=False, kv_len=10)
  assert res.anon_bytes == res.dense_bytes + res.kv_bytes
  # K = 2 > S = 1: one staging slot
  assert memory.plan_memory(tiny(), jnp.float32, cache_fraction=0.125, kv_len=10).cache_slots == 3
  # no policy: every expert on the device
  full = memory.plan_memory(tiny(), jnp.float32, offload=False, kv_len=10)
  assert full.expert_cache_bytes == 2 * 8 * 384 and full.prefill_bytes == 0


def test_bytes_of_real_expert_shapes():
  gpt_oss_20b = ModelConfig.from_hf_dict(dict(
      model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
      num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
      num_local_experts=32, num_experts_per_tok=4, sliding_window=128))
  # MXFP4 blocks 12,441,600 + scales 777,600 + bf16 biases 17,280 (the README's table)
  assert memory.expert_nbytes(gpt_oss_20b, jnp.bfloat16, mxfp4=True) == 13_236_480
  assert memory.expert_nbytes(gpt_oss_20b, jnp.bfloat16) == 49_783_680


def test_plan_matches_the_loaded_demo_model():
  from moejax.io.loader import load_model
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  p = memory.plan_memory(cfg, jnp.float32)
  assert p.expert_bytes == store.expert_nbytes()
  assert p.dense_bytes == memory.tree_nbytes(params)
  assert p.all_experts_bytes == sum(memory.tree_nbytes(store.stacked(l)) for l in store.moe_layers)
  assert not memory.checkpoint_is_mxfp4(DEMO)
