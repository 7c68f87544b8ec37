"""Time per token of the offload presets at a 25% expert budget, scaled and native link.

  python -m launch.bench_offload --out=bench_offload.json

Model: the demo model at --model_dir (ckpts/demo) when it exists, else a
random-weight model of the same shape (Qwen3-MoE, hidden 128, 8 layers, 64
experts of 32, top-8, vocab 8192), said so in the output.

Every preset decodes the same teacher-forced token stream (so all see the same
inputs), after a prompt and `--warmup_tokens` untimed tokens.  The caches start
from the experts most often routed on a separate profiling stream.

Per preset and link:
  tpot_ms         measured wall time per decoded token (mean)
  lower_bound_ms  compute_ms + host_ms + (sync fetches per token) x (one expert's
                  transfer time at link speed): zero-overhead time of the same
                  decisions, where compute_ms is this engine's time per token with
                  every expert resident (no transfers at all) and host_ms the
                  host preset's measured numpy expert time.  A native link's
                  transfer time is the median time of one expert's owned
                  `device_put` measured here (no thread hand-off).
Every time names its link.  Figures are wall-clock on a shared machine.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import sysconfig
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.loader import init_random, load_model
from moejax.offload import calibrate
from moejax.offload.engine import OffloadEngine
from moejax.offload.link import parse_link
from moejax.store import ExpertStore

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_offload.json", "JSON results file.")
flags.DEFINE_string("model_dir", "ckpts/demo", "HF folder of the model (random weights if absent).")
flags.DEFINE_bool("random_model", False, "Use a random-weight model even if --model_dir exists.")
flags.DEFINE_enum("shape", "demo", ["demo", "qwen3-30b-a3b"],
                  "Random-weight shape: the demo model, or Qwen3-30B-A3B's expert/attention "
                  "shape with --layers layers (for an accelerator run).")
flags.DEFINE_integer("layers", 0, "Layers of the random-weight model (0: the shape's default).")
flags.DEFINE_list("presets", ["baseline", "quality", "speed", "host", "substitute_all"],
                  "Policies to time.")
flags.DEFINE_list("links", ["scaled", "native"], "--link specs to time side by side.")
flags.DEFINE_float("cache_fraction", 0.25, "Experts per layer resident.")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
flags.DEFINE_integer("warmup_tokens", 16, "Decoded tokens not timed (cache warm-up, compile).")
flags.DEFINE_integer("decode_tokens", 64, "Decoded tokens timed.")
flags.DEFINE_integer("seed", 0, "Token stream seed (random-weight model).")
flags.DEFINE_bool("run_layers", True, "OffloadEngine(run_layers=): the layers that need no "
                  "host work in one call (False: one call per MoE layer, see --fuse_layers).")
flags.DEFINE_bool("fuse_layers", True, "OffloadEngine(fuse_layers=), with --run_layers=false: "
                  "a MoE layer's moe call in the same call as the next layer's decision "
                  "(False: separate calls).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute/parameter dtype.")
flags.DEFINE_enum("scaled_compute", "model", ["model", "engine"],
                  "Layer compute time the scaled link is sized against: 'model' = one MoE "
                  "layer's jitted decode step with its own experts resident (the computation "
                  "alone); 'engine' = this engine's all-resident time per token / layers (incl. its per-layer "
                  "host round trips).")


def demo_shape(layers: int) -> ModelConfig:
  return ModelConfig(model_type="qwen3_moe", vocab_size=8192, hidden_size=128,
                     num_layers=layers or 8, num_heads=4, num_kv_heads=2, head_dim=32,
                     num_experts=64, top_k=8, moe_intermediate_size=32, intermediate_size=512,
                     sparse_layers=(True,) * (layers or 8), qk_norm="head",
                     norm_topk_prob=True).validate()


def qwen3_30b_shape(layers: int) -> ModelConfig:
  n = layers or 4
  return ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     num_layers=n, num_heads=32, num_kv_heads=4, head_dim=128,
                     num_experts=128, top_k=8, moe_intermediate_size=768,
                     intermediate_size=6144, sparse_layers=(True,) * n, qk_norm="head",
                     norm_topk_prob=True).validate()


def load(dtype):
  """(cfg, params, store, token stream source, description)."""
  if not FLAGS.random_model and os.path.exists(os.path.join(FLAGS.model_dir, "config.json")):
    cfg, params, store = load_model(FLAGS.model_dir, dtype=dtype)
    tok_path = os.path.join(FLAGS.model_dir, "tokenizer.json")
    return cfg, params, store, tok_path if os.path.exists(tok_path) else None, FLAGS.model_dir
  cfg = demo_shape(FLAGS.layers) if FLAGS.shape == "demo" else qwen3_30b_shape(FLAGS.layers)
  params, exps = init_random(cfg, seed=0, dtype=dtype)
  # random routers are nearly uniform; widen them so routing has a real model's skew
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 25 if "mlp" in jax.tree_util.keystr(p) and "gate" in
      jax.tree_util.keystr(p) else x, params)
  desc = (f"RANDOM-WEIGHT model of the {FLAGS.shape} shape "
          f"({'no model at ' + FLAGS.model_dir if not FLAGS.random_model else '--random_model'})")
  return cfg, params, ExpertStore.from_stacked(exps), None, desc


def token_streams(cfg, tok_path, n: int):
  """(profiling stream, measured stream): held-out text when a tokenizer exists."""
  if tok_path:
    from moejax.tokenizer import Tokenizer
    tok = Tokenizer(tok_path)
    lib = sysconfig.get_paths()["stdlib"]
    texts = [open(p, errors="ignore").read() for p in sorted(glob.glob(os.path.join(lib, "json",
                                                                                     "*.py")))]
    ids = tok.encode("\n".join(texts))
    if len(ids) >= 2 * n:
      return ids[:n], ids[n:2 * n]
  rng = np.random.default_rng(FLAGS.seed)
  return ([int(t) for t in rng.integers(0, cfg.vocab_size, n)],
          [int(t) for t in rng.integers(0, cfg.vocab_size, n)])


def native_transfer_seconds(store, layer: int, host_copies: bool, reps: int = 30) -> float:
  """Median time of one expert's copy as the engine makes it on the native link: a
  private host stack on the CPU backend (`Prefetcher(host_copies=True)`), else an owned
  host->device `device_put`."""
  from moejax.offload import copies
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  times = []
  for i in range(reps):
    src = store.get(layer, i % store.layers[layer].num_experts)
    t0 = time.perf_counter()
    if host_copies:
      copies.host_stack([src])
    else:
      jax.block_until_ready({k: copies.owned_device_put(v, sh) for k, v in src.items()})
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def make_engine(stack, cfg, params, store, policy, link, stream, counts, dtype, fraction):
  """An engine entered into `stack` (closed however the run ends), warmed up and prefilled."""
  eng = stack.enter_context(OffloadEngine(cfg, params, store, policy, cache_fraction=fraction,
                                          link=link, max_len=len(stream) + 8, dtype=dtype,
                                          initial="profile", profile_counts=counts,
                                          fuse_layers=FLAGS.fuse_layers,
                                          run_layers=FLAGS.run_layers))
  eng.warmup()
  eng.prefill(stream[:FLAGS.prompt_len])
  return eng


def run_interleaved(engines: list, stream: list, block: int = 8):
  """Decodes `stream` on every engine, `block` tokens at a time in turn, so that the
  load of a shared machine falls on all of them alike."""
  pos = FLAGS.prompt_len
  while pos < len(stream):
    for eng in engines:
      for t in stream[pos:pos + block]:
        eng.decode_step(t)
    pos += block


def main(_):
  with contextlib.ExitStack() as stack:
    run(stack)


def run(stack: contextlib.ExitStack):
  dtype = jnp.dtype(FLAGS.dtype)
  if jax.devices()[0].platform == "cpu":
    # per-layer steps sync with the host every layer: run them on the calling thread
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  cfg, params, store, tok_path, desc = load(dtype)
  n = FLAGS.prompt_len + FLAGS.warmup_tokens + FLAGS.decode_tokens
  prof_stream, stream = token_streams(cfg, tok_path, n)
  counts = calibrate.profile_counts(cfg, params, store, prof_stream, dtype)
  ebytes = store.expert_nbytes()
  print(f"[bench_offload] {desc}: {cfg.num_layers} layers, {cfg.num_experts} experts top-"
        f"{cfg.top_k}, expert {ebytes} bytes, {jax.devices()[0].platform}; "
        f"{FLAGS.decode_tokens} timed tokens after {FLAGS.warmup_tokens} warm-up",
        file=sys.stderr)

  layer_s = calibrate.layer_compute_seconds(cfg, params, store, dtype)
  model_layer_s = layer_s
  if FLAGS.scaled_compute == "engine":
    with OffloadEngine(cfg, params, store, "baseline", cache_fraction=1.0,
                       max_len=len(prof_stream) + 8, dtype=dtype) as e:
      e.warmup()
      e.prefill(prof_stream[:FLAGS.prompt_len])
      for t in prof_stream[FLAGS.prompt_len:FLAGS.prompt_len + 48]:
        e.decode_step(t)
      layer_s = e.stats(skip=8)["tpot_median_ms"] * 1e-3 / cfg.num_layers
  links = {spec: (parse_link(spec, expert_bytes=ebytes, layer_compute_s=layer_s)
                  if spec.startswith("scaled") else parse_link(spec, expert_bytes=ebytes))
           for spec in FLAGS.links}
  mk = lambda pol, link, f: make_engine(stack, cfg, params, store, pol, link, stream, counts,
                                        dtype, f)
  compute_eng = mk("baseline", links[FLAGS.links[0]], 1.0)
  runs = {(spec, preset): mk(preset, link, FLAGS.cache_fraction)
          for spec, link in links.items() for preset in FLAGS.presets}
  t0 = time.time()
  run_interleaved([compute_eng] + list(runs.values()), stream)
  wall = time.time() - t0
  compute = compute_eng.stats(skip=FLAGS.warmup_tokens)
  compute_ms = compute["tpot_ms"]
  result = {
      "model": desc, "model_type": cfg.model_type, "layers": cfg.num_layers,
      "experts": cfg.num_experts, "top_k": cfg.top_k, "expert_bytes": ebytes,
      "device": str(jax.devices()[0]), "cache_fraction": FLAGS.cache_fraction,
      "decode_tokens": FLAGS.decode_tokens, "warmup_tokens": FLAGS.warmup_tokens,
      "scaled_compute": FLAGS.scaled_compute,
      "scaled_link_layer_compute_ms": 1e3 * layer_s,
      "layer_step_x_layers_ms": 1e3 * model_layer_s * cfg.num_layers,
      "engine_all_resident_tpot_ms": compute_ms,
      "engine_all_resident_tpot_median_ms": compute["tpot_median_ms"],
      "bench_wall_s": wall,
      "links": {},
  }
  print(f"[bench_offload] all experts resident: jitted whole-model step "
        f"{1e3 * model_layer_s * cfg.num_layers:.2f} ms/token (one layer's jitted step x layers); this engine (per-layer steps, no "
        f"transfers) {compute_ms:.2f} ms/token (median {compute['tpot_median_ms']:.2f})",
        file=sys.stderr)
  host_copies = compute_eng.transfer_stats()["host_copies"]
  native_put_s = native_transfer_seconds(store, cfg.moe_layers[0], host_copies)
  result["native_expert_transfer_ms"] = 1e3 * native_put_s
  result["native_transfer"] = "host stack" if host_copies else "device_put"
  for spec, link in links.items():
    per_fetch = link.transfer_time(ebytes) if link.emulated else native_put_s
    rows = {}
    for preset in FLAGS.presets:
      eng = runs[(spec, preset)]
      s = eng.stats(skip=FLAGS.warmup_tokens)
      lb = compute_ms + s["host_ms_per_token"] + 1e3 * per_fetch * s["fetches_per_token"]
      rows[preset] = dict(
          policy=eng.policy.describe(), tpot_ms=s["tpot_ms"], lower_bound_ms=lb,
          tpot_over_lower_bound=s["tpot_ms"] / lb, tpot_median_ms=s["tpot_median_ms"],
          substituted_call_pct=s["substituted_call_pct"], hit_rate=s["hit_rate"], stats=s,
          budget=eng.budget.as_dict())
    base = rows.get("baseline", {}).get("tpot_ms")
    for r in rows.values():
      r["speedup_vs_baseline"] = base / r["tpot_ms"] if base else None
    result["links"][spec] = dict(link=link.describe(), bandwidth_Bps=link.bandwidth_Bps,
                                 latency_s=link.latency_s, expert_transfer_ms=1e3 * per_fetch,
                                 presets=rows)
    print(table(rows, link.describe()))
  first = result["links"][FLAGS.links[0]]
  result["link"], result["presets"] = first["link"], first["presets"]
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=2, default=float)
  print(f"[bench_offload] wrote {FLAGS.out}", file=sys.stderr)


def table(rows: dict, link_desc: str) -> str:
  head = (f"link: {link_desc}\n"
          f"{'preset':<15}{'tpot ms':>9}{'bound ms':>10}{'/bound':>8}{'x base':>8}"
          f"{'hit %':>7}{'subst %':>9}{'fetch/tok':>10}{'wait ms':>9}{'adm/tok':>8}")
  lines = [head]
  # tpot: mean over timed tokens; bound: zero-overhead time of the same decisions
  for name, r in rows.items():
    s = r["stats"]
    sp = r["speedup_vs_baseline"]
    lines.append(f"{name:<15}{r['tpot_ms']:>9.2f}{r['lower_bound_ms']:>10.2f}"
                 f"{r['tpot_over_lower_bound']:>8.2f}{(sp or 0):>8.2f}"
                 f"{100 * r['hit_rate']:>7.1f}{r['substituted_call_pct']:>9.1f}"
                 f"{s['fetches_per_token']:>10.2f}"
                 f"{s['wait_ms_per_token'] + s['admission_wait_ms_per_token']:>9.2f}"
                 f"{s['admissions_per_token']:>8.2f}")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
