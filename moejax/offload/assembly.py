"""What an `OffloadEngine` decodes from, built from its `EngineConfig` (the engine's
constructor): the expert budget and the expert-parallel plan, the low-precision copies and
the host staging tier, the MoE layers' expert sources, and the initial resident states.
"""

from __future__ import annotations

import jax.numpy as jnp

from moejax.cache import initial as initial_lib
from moejax.cache import policy as policy_lib
from moejax.cache import resident as resident_lib
from moejax.io import quant, staging
from moejax.io.store import store_backend
from moejax.model.config import ModelConfig
from moejax.offload import expert_parallel
from moejax.offload import decode
from moejax.offload.config import EngineConfig, check_policy
from moejax.prefetch import speculation
from moejax.prefetch import steps as pf_steps


def check_args(config, counts):
  """The engine's constructor arguments: an `EngineConfig`, and counts with "profile"."""
  if not isinstance(config, EngineConfig):
    raise TypeError(f"OffloadEngine takes an EngineConfig, got {type(config).__name__} "
                    f"(EngineConfig.make({config!r}, ...) builds one from a policy name; "
                    f"OffloadEngine.from_model(model, ...) from a moejax.Model)")
  if (config.initial == "profile") != (counts is not None):
    raise ValueError("initial='profile' needs the routing counts (counts=...), and "
                     "counts need initial='profile'")


def budget_and_plan(cfg: ModelConfig, store, config: EngineConfig):
  """(the expert budget, `resident.make_budget`; the plan over config.expert_devices > 1
  devices, or None)."""
  devices = config.expert_devices
  budget = resident_lib.make_budget(cfg.num_experts, cfg.top_k, store.expert_nbytes(),
                                    len(cfg.moe_layers), fraction=config.cache_fraction,
                                    nbytes=config.cache_bytes,
                                    streaming=config.prefetch.streaming, devices=devices)
  plan = (expert_parallel.make_plan(devices, budget.slots_per_device) if devices > 1
          else None)
  return budget, plan


def side_stores(store, config: EngineConfig, platform: str, low_store=None):
  """(the low-precision copies a policy that fetches them reads: `low_store`, default
  quantised now; the host staging tier of config.host_cache_bytes, `io.staging`, or
  without one a tier without rows for a mapped store jax cannot wrap in place,
  `staging.read_through`), each None where unused; the policy checked against them
  (`check_policy`)."""
  policy = config.policy
  low = None
  if policy.decision.low:
    low = low_store or quant.build(store, policy.decision.low_bits)
  check_policy(policy, platform, low)
  staged = (staging.StagingCache(store, config.host_cache_bytes)
            if config.host_cache_bytes is not None else
            None if policy.decision.host else staging.read_through(store, platform))
  return low, staged


def expert_sources(cfg: ModelConfig, host, pf, mode: pf_steps.Mode, scan: bool, put):
  """Each layer's expert source for `decode.moe_layer`: its host store (`host`, placed) and,
  with prefetch, its predictors (`pf`, a `Prefetch`) put on the device(s) by `put`: one
  stacked tree (a scan), or a list per layer (None: a dense layer)."""
  preds = (speculation.stacked_predictors(cfg, pf.kind, pf.predictors, stack=scan)
           if mode.on and pf.kind != "oracle" else None)
  zero = jnp.zeros(((cfg.num_layers,) if scan else ()) + (cfg.num_experts, cfg.hidden_size),
                   jnp.float32)
  more = lambda i: ((put(preds) if i is None else put(preds[i])) if preds else
                    {"vectors": zero} if mode.on else {})     # oracle: vectors unused
  if scan:
    return dict(host, **more(None))
  return [None if i not in host else dict(host[i], **more(i)) for i in range(cfg.num_layers)]


def initial_states(store, cfg: ModelConfig, budget: resident_lib.Budget, initial: str,
                   policy: policy_lib.PolicyParams, mode: pf_steps.Mode, device, scan: bool,
                   counts, plan):
  """The MoE layers' ResidentStates filled with `initial` (`cache.initial`; resolved),
  stacked for a scan, sharded over the plan's devices."""
  rows = cfg.top_k if mode.on else 0      # prefetch rows after the scratch row
  states = initial_lib.engine_states(store, cfg, tuple(cfg.moe_layers), budget, initial,
                                     policy.cache, rows, device, stacked=scan, counts=counts)
  if plan is not None:
    states = {l: expert_parallel.shard_state(plan, st) for l, st in states.items()}
  return states


def layer_ctx(engine, pinned: bool) -> decode.Ctx:
  """The static part of the engine's layer step (`decode.Ctx.make`): slots filled by
  in-program copies; every hit for good when every expert stays resident."""
  return decode.Ctx.make(
      engine.cfg, engine.config, engine.budget, source="slots", pinned=pinned,
      mapped=store_backend(engine.store) == "mmap",
      skip_empty=engine.device.platform == "cpu", ep=engine.plan,
      all_resident=(engine.budget.all_resident and engine.initial == "all"
                    and not engine.mode.on))
