"""The engine's decode step: compile time against depth, layers scanned or unrolled
(issue 45, item 3: "compile time bounded and independent of depth").

  MOEJAX_COMPILE_CACHE=0 python -m launch.bench_compile_depth \\
      --out=docs/lab/runs/2026-12-05-engine4-scan/compile_depth.json

Not part of the tests. The step (`decode.step_fn`) of Qwen3-30B-A3B's layer width
(`--width=wide`, bench_models' wide config) or of a narrow model (`--width=narrow`: hidden
256, 16 experts) is lowered and compiled from abstract arguments (shapes only: no model is
written or read, so 24 real-width layers need no 30 GB on disk), as `OffloadEngine.warmup`
compiles it: bf16, a store of uint16 bf16 bits, --max_len, one device. Per --policies
("all": every expert resident, the all-resident program; else a preset at
--cache_fraction) and per depth in --layers, with the layers scanned
(`Program.scan`) and unrolled, --repeats times each (median), alternating.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.models import wide_config
from moejax.offload.config import EngineConfig
from moejax.cache import resident as resident_lib
from moejax.io.loader import expert_shapes
from moejax.model.model import abstract_params
from moejax.model import layer_stack
from moejax.model.config import ModelConfig
from moejax.offload import decode

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "compile_depth.json", "JSON results file.")
flags.DEFINE_enum("width", "wide", ["wide", "narrow"], "Layer width.")
flags.DEFINE_list("layers", ["4", "24"], "Depths.")
flags.DEFINE_list("policies", ["quality", "all"], "Presets, or 'all' (all resident).")
flags.DEFINE_float("cache_fraction", 0.25, "Budget of the presets.")
flags.DEFINE_integer("max_len", 512, "KV cache length.")
flags.DEFINE_integer("repeats", 1, "Compiles per case (median).")


def narrow_config(layers: int) -> ModelConfig:
  return ModelConfig(model_type="qwen3_moe", vocab_size=1024, hidden_size=256,
                     num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=64,
                     num_experts=16, top_k=4, moe_intermediate_size=128,
                     intermediate_size=512, sparse_layers=(True,) * layers, qk_norm="head",
                     norm_topk_prob=True).validate()


def abstract_step(cfg: ModelConfig, policy: str, scan: bool):
  """(the jitted step, its abstract arguments) as the engine builds them."""
  dt = jnp.bfloat16
  shapes = expert_shapes(cfg)
  ebytes = sum(int(np.prod(s)) * 2 for s in shapes.values())
  all_res = policy == "all"
  budget = resident_lib.make_budget(cfg.num_experts, cfg.top_k, ebytes, len(cfg.moe_layers),
                                    fraction=1.0 if all_res else FLAGS.cache_fraction)
  config = EngineConfig.make("baseline" if all_res else policy, max_len=FLAGS.max_len)
  ctx = decode.Ctx.make(cfg, config, budget, source="slots", skip_empty=True,
                           all_resident=all_res and budget.all_resident)
  prog = decode.Program(ctx, "bfloat16", FLAGS.max_len, scan)
  sds = lambda t: jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
  spec = {k: (s, dt) for k, s in shapes.items()}
  states = {l: jax.eval_shape(lambda: resident_lib.init_state(cfg.num_experts, budget.physical,
                                                              spec)) for l in cfg.moe_layers}
  params = abstract_params(cfg, dt)
  n = len(cfg.moe_layers)
  if scan:
    params = jax.eval_shape(lambda p: decode.stack_params(cfg, p), params)
    states = jax.eval_shape(lambda s: layer_stack.stack_states(cfg, s), states)
    srcs = {"store": {k: jax.ShapeDtypeStruct((n, cfg.num_experts) + s, jnp.uint16)
                      for k, s in shapes.items()}}
  else:
    srcs = [{"store": {k: jax.ShapeDtypeStruct((cfg.num_experts,) + s, jnp.uint16)
                       for k, s in shapes.items()}} for _ in range(cfg.num_layers)]
  cache, _, pending = jax.eval_shape(lambda: decode.empty_carry(ctx, dt, FLAGS.max_len, {}, scan))
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  return decode.step_fn(prog), (sds(params), srcs, (cache, states, pending), i32, i32)


def compile_s(cfg, policy: str, scan: bool) -> float:
  fn, args = abstract_step(cfg, policy, scan)
  jax.clear_caches()
  t0 = time.perf_counter()
  fn.lower(*args).compile()
  return time.perf_counter() - t0


def main(argv):
  del argv
  make = wide_config if FLAGS.width == "wide" else narrow_config
  depths = [int(x) for x in FLAGS.layers]
  runs = {}
  for _ in range(FLAGS.repeats):
    for pol in FLAGS.policies:
      for depth in depths:
        for scan in (True, False):
          key = f"{pol} {depth}L {'scan' if scan else 'unrolled'}"
          runs.setdefault(key, []).append(compile_s(make(depth), pol, scan))
          print(f"{key:28s} {runs[key][-1]:7.2f} s", flush=True)
  med = {k: statistics.median(v) for k, v in runs.items()}
  ratios = {f"{pol} {mode} {depths[-1]}L/{depths[0]}L":
            med[f"{pol} {depths[-1]}L {mode}"] / med[f"{pol} {depths[0]}L {mode}"]
            for pol in FLAGS.policies for mode in ("scan", "unrolled")}
  for k, v in ratios.items():
    print(f"{k:36s} x{v:.2f}")
  res = {"width": FLAGS.width, "layers": depths, "policies": FLAGS.policies,
         "cache_fraction": FLAGS.cache_fraction, "max_len": FLAGS.max_len,
         "compile_cache": os.environ.get("MOEJAX_COMPILE_CACHE", "1"),
         "load_avg": os.getloadavg(), "compile_s": runs, "median_s": med, "ratios": ratios}
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
