"""Time per token of the offload presets against the all-resident Sampler, in one run.

  python -m launch.bench_offload --out=bench_offload.json

Model: the demo model at --model_dir (ckpts/demo; or any FILE.gguf) when it exists, else a
random-weight model of the demo's shape (Qwen3-MoE, hidden 128, 8 layers, 64 experts of 32,
top-8, vocab 8192), or of Qwen3-30B-A3B's with --shape (said so in the output).
--model=wide_bf16: `benchmarks.models`' real-width checkpoint (Qwen3-30B-A3B's layers,
per-expert bf16 safetensors, written once), loaded straight into the --store back-end;
--model=wide_q8_0 / wide_q4_0 / wide_q4_k_m: the one GGUF that bench_peers gives both
engines (`benchmarks.models.wide_gguf`), run in place (the plans count its blocks):

  python -m launch.bench_offload --model=wide_bf16 --store=mmap --links=native

The experts wait in a --store back-end (numpy, mmap, pinned_host).  The JSON also holds
the load time, each runner's compile time and memory plan, and the process's peak anon RSS.

Every preset decodes the same teacher-forced token stream (so all see the same
inputs): the held-out text of benchmarks/stream.py (the one bench_peers and bench_scale
decode), after a prompt and `--warmup_tokens` untimed tokens, one `decode_step` per token
(the per-token path of `generate`).  The caches start from the experts most often routed on
a profiling stream of the train split.  The JSON's `routing` is the stream's (the LRU hit at
25% and the 8-busiest share, from the all-resident engine's records); each preset reports
its hit rate and misses per token.  Timed beside them, on the same tokens: the all-resident `moejax.model.sampler.Sampler`
(one jitted `decode_step` call per token, its logits read back as the engine's are)
and the OffloadEngine with every expert resident.  The timed tokens are cut into
`--rounds` blocks; in each round every runner decodes that block in turn (rotated
order), so the load of a shared machine falls on all alike.  A runner's time per token
is the median over rounds of its round's mean (ms per token).

Per preset and link: tpot_ms (the median above), tpot_over_sampler, lower_bound_ms (the
same decisions with no overhead beyond the Sampler's step, the fetches' in-program copies,
each one expert's copy from this run's store into a slot buffer as measured here the way
`launch.bench_transfer` does, and an emulated link's waits: the JSON's "lower_bound" spells
it out), tpot_over_lower_bound, and the engine's per-token statistics (`stats`: means over
the timed tokens' records).
Every time names its link.  --unrolled: every engine also with its layers unrolled
(`layer_scan=False`), in the same rounds (`scan_over_unrolled`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import models as bench_models
from benchmarks import routing, stream
from benchmarks.offload_report import LOWER_BOUND, preset_rows, scan_over_unrolled, table
from benchmarks.transfer import expert_copy_seconds
from moejax.io.loader import init_random, load_model
from moejax.offload import calibrate
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.io.store import BACKENDS, ExpertStore, StoreBackendError, make_store
from moejax.offload.link import parse_link
from moejax.model.sampler import Sampler, SamplingParams
from moejax.kernels import cpu_kernel

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_offload.json", "JSON results file.")
flags.DEFINE_string("model_dir", "ckpts/demo", "HF folder of the model, or a GGUF file "
                    "(random weights if absent).")
flags.DEFINE_enum("model", "dir", ["dir", "wide_bf16", "wide_q8_0", "wide_q4_0", "wide_q4_k_m"],
                  "dir: --model_dir (or a random model); wide_bf16: Qwen3-30B-A3B's layer "
                  "width, random bf16, per-expert safetensors (benchmarks.models; written once "
                  "to --wide_root), loaded with --store; wide_q*: as one GGUF, run in place.")
flags.DEFINE_integer("wide_layers", 4, "Layers of the wide models.")
flags.DEFINE_bool("unrolled", False, "Also time every engine with its layers unrolled "
                  "(EngineConfig(layer_scan=False)) in the same rounds: the layer scan's "
                  "before/after.")
flags.DEFINE_string("wide_root", None, "Folder of the wide models (default: "
                    "~/.cache/moejax/models).")
flags.DEFINE_bool("random_model", False, "Use a random-weight model even if --model_dir exists.")
flags.DEFINE_enum("shape", "demo", ["demo", "qwen3-30b-a3b"],
                  "Random-weight shape: the demo model, or Qwen3-30B-A3B's expert/attention "
                  "shape with --layers layers (for an accelerator run).")
flags.DEFINE_integer("layers", 0, "Layers of the random-weight model (0: the shape's default).")
flags.DEFINE_list("presets", ["baseline", "quality", "speed", "host", "substitute_all"],
                  "Policies to time ('host' only on the CPU backend).")
flags.DEFINE_list("links", ["scaled", "native"], "--link specs to time side by side.")
flags.DEFINE_enum("store", "numpy", list(BACKENDS), "Expert store back-end "
                  "(moejax.io.store.make_store).")
flags.DEFINE_float("cache_fraction", 0.25, "Experts per layer resident.")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
flags.DEFINE_integer("warmup_tokens", 16, "Decoded tokens not timed (cache warm-up, compile).")
flags.DEFINE_integer("decode_tokens", 256, "Decoded tokens timed.")
flags.DEFINE_integer("rounds", 8, "Interleaved rounds the timed tokens are cut into.")
flags.DEFINE_integer("seed", 0, "Token stream seed (random-weight model).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute/parameter dtype.")
flags.DEFINE_enum("scaled_compute", "model", ["model", "engine"],
                  "Layer compute time the scaled link is sized against: 'model' = one MoE "
                  "layer's jitted decode step with its own experts resident (the computation "
                  "alone); 'engine' = the all-resident engine's time per token / layers.")

def load(dtype):
  """(cfg, params, store, token stream source, description, a GGUF's (dense, expert) bytes
  for the plans or None)."""
  root = FLAGS.wide_root or bench_models.WIDE_DIR
  if FLAGS.model == "wide_bf16":
    d = bench_models.wide_dir(FLAGS.wide_layers, root)
    bench_models.save_wide(d, FLAGS.wide_layers)
    cfg, params, store = load_model(d, dtype=dtype, mmap=FLAGS.store != "numpy")
    return cfg, params, store, os.path.join(d, "tokenizer.json"), f"wide_bf16 ({d})", None
  gguf = (bench_models.wide_gguf(FLAGS.wide_layers, bench_models.weights_of(FLAGS.model),
                                 root=root) if FLAGS.model != "dir" else
          FLAGS.model_dir if FLAGS.model_dir.endswith(".gguf") and not FLAGS.random_model
          else None)
  if gguf:        # read in place: the experts stay in the mapped file unless --store=numpy
    from moejax.io.weights import gguf_file
    cfg, params, store = load_model(gguf, dtype=dtype, mmap=FLAGS.store != "numpy")
    return (cfg, params, store, gguf_file.tokenizer_path(gguf),
            f"{FLAGS.model if FLAGS.model != 'dir' else 'GGUF'} ({gguf})",
            gguf_file.nbytes(gguf_file.tensor_info(gguf)[0]))
  if not FLAGS.random_model and os.path.exists(os.path.join(FLAGS.model_dir, "config.json")):
    cfg, params, store = load_model(FLAGS.model_dir, dtype=dtype)
    tok_path = os.path.join(FLAGS.model_dir, "tokenizer.json")
    return cfg, params, store, tok_path if os.path.exists(tok_path) else None, FLAGS.model_dir, None
  cfg = (bench_models.demo_shape if FLAGS.shape == "demo" else bench_models.qwen3_30b_shape)(
      FLAGS.layers)
  params, exps = init_random(cfg, seed=0, dtype=dtype)
  # random routers are nearly uniform; widen them so routing has a real model's skew
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 25 if "mlp" in jax.tree_util.keystr(p) and "gate" in
      jax.tree_util.keystr(p) else x, params)
  desc = (f"RANDOM-WEIGHT model of the {FLAGS.shape} shape "
          f"({'no model at ' + FLAGS.model_dir if not FLAGS.random_model else '--random_model'})")
  return cfg, params, ExpertStore.from_stacked(exps), None, desc, None


def token_streams(cfg, tok_path, n: int):
  """(profiling stream, measured stream): the held-out text of benchmarks/stream.py when a
  tokenizer exists (the profile is the calibration text of the train split), else random."""
  if tok_path:
    return stream.calibration_ids(tok_path, n), stream.held_out_ids(tok_path, n)
  rng = np.random.default_rng(FLAGS.seed)
  return ([int(t) for t in rng.integers(0, cfg.vocab_size, n)],
          [int(t) for t in rng.integers(0, cfg.vocab_size, n)])


class SamplerRun:
  """The all-resident Sampler behind the engine's interface: prefill, then one jitted
  `decode_step` per teacher-forced token, its logits read back to the host."""

  def __init__(self, cfg, params, experts, dtype, max_len: int):
    self.s = Sampler(cfg, params, experts, max_len=max_len, dtype=dtype)
    self.sp, self.key = SamplingParams(), jax.random.PRNGKey(0)
    self.cache, self.pos = None, 0

  def prefill(self, ids):
    logits, self.cache = self.s.prefill(np.asarray([ids], np.int32))
    self.pos = len(ids)
    return np.asarray(logits[0])

  def decode_step(self, token: int):
    _, logits, self.cache = self.s.decode_step(self.cache, np.asarray([token], np.int32),
                                               self.pos, self.sp, self.key)
    self.pos += 1
    return np.asarray(logits[0])


def make_engine(stack, cfg, params, store, policy, link, stream, counts, dtype, fraction,
                scan=True):
  """An engine entered into `stack` (closed however the run ends), warmed up and prefilled;
  its cache starts from `counts`' most used experts ("auto": all, at fraction 1)."""
  profiled = fraction < 1
  config = EngineConfig.make(policy, cache_fraction=fraction, link=link,
                             max_len=len(stream) + 8, dtype=dtype, layer_scan=scan,
                             initial="profile" if profiled else "auto")
  eng = stack.enter_context(OffloadEngine(cfg, params, store, config,
                                          counts=counts if profiled else None))
  t0 = time.perf_counter()
  eng.warmup()
  eng.compile_s = time.perf_counter() - t0
  eng.prefill(stream[:FLAGS.prompt_len])
  return eng


def plans(cfg, dtype, max_len: int, presets, nbytes=None) -> dict:
  """The memory plan (`offload.memory`) of each runner's own run, as the CLI prints it
  (`nbytes`: a GGUF's (dense, expert) bytes, as moejax-generate plans a GGUF)."""
  from moejax.offload.memory import plan_memory
  mk = lambda offload, f: plan_memory(cfg, dtype, store=FLAGS.store, offload=offload,
                                      cache_fraction=f, kv_len=max_len, nbytes=nbytes).as_dict()
  return {"sampler": mk(False, None), "all_resident": mk(True, 1.0),
          **{p: mk(True, FLAGS.cache_fraction) for p in presets}}


def run_rounds(runners: dict, stream: list) -> dict:
  """Warm-up tokens on every runner, then the timed tokens in --rounds blocks: in round
  r every runner decodes block r in turn, starting at runner r.  -> {name: [mean ms
  per token of each round]}."""
  pos = FLAGS.prompt_len
  for r in runners.values():
    for t in stream[pos:pos + FLAGS.warmup_tokens]:
      r.decode_step(t)
  timed = stream[pos + FLAGS.warmup_tokens:]
  blocks = [b for b in np.array_split(np.arange(len(timed)), max(1, FLAGS.rounds)) if len(b)]
  names = list(runners)
  per = {n: [] for n in names}
  for i, blk in enumerate(blocks):
    for name in names[i % len(names):] + names[:i % len(names)]:
      run = runners[name]
      t0 = time.perf_counter()
      for j in blk:
        run.decode_step(timed[j])
      per[name].append(1e3 * (time.perf_counter() - t0) / len(blk))
  return per


def main(_):
  from moejax.offload.memory import AnonWatch
  with cpu_kernel.decoding(), AnonWatch() as watch, contextlib.ExitStack() as stack:
    run(stack, watch)                                  # kernel helpers stay awake


def run(stack: contextlib.ExitStack, watch):
  dtype = jnp.dtype("bfloat16" if FLAGS.model.startswith("wide") else FLAGS.dtype)
  platform = jax.devices()[0].platform
  presets = list(FLAGS.presets)
  skip = ("it computes misses on the host CPU, which needs the CPU backend" if platform != "cpu"
          else "the engine cannot compute host experts from a pinned_host store yet (XLA's CPU "
          "dot refuses a pinned_host operand); use --store=numpy or mmap"
          if FLAGS.store == "pinned_host" else None)
  if skip and "host" in presets:
    presets.remove("host")
    print(f"[bench_offload] 'host' skipped: {skip}", file=sys.stderr)
  t0 = time.perf_counter()
  cfg, params, store, tok_path, desc, nbytes = load(dtype)
  load_s = time.perf_counter() - t0
  n = FLAGS.prompt_len + FLAGS.warmup_tokens + FLAGS.decode_tokens
  prof_stream, stream = token_streams(cfg, tok_path, n)
  counts = calibrate.profile_counts(cfg, params, store, prof_stream, dtype)
  experts = store.device_experts(dtype)       # the Sampler's, before the store moves
  try:
    store = make_store(store, FLAGS.store)
  except StoreBackendError as e:
    raise app.UsageError(str(e)) from None
  ebytes = store.expert_nbytes()
  print(f"[bench_offload] {desc}: {cfg.num_layers} layers, {cfg.num_experts} experts top-"
        f"{cfg.top_k}, expert {ebytes} bytes, {FLAGS.store} store, {platform}; "
        f"{FLAGS.decode_tokens} timed tokens in {FLAGS.rounds} rounds after "
        f"{FLAGS.warmup_tokens} warm-up", file=sys.stderr)

  copy = expert_copy_seconds(store)
  copy_ms = 1e3 * min(copy["copy_s"], copy["copy_in_loop_s"])
  scaled = any(s.startswith("scaled") for s in FLAGS.links)
  layer_s = calibrate.layer_compute_seconds(cfg, params, store, dtype) if scaled else None
  model_layer_s = layer_s
  if FLAGS.scaled_compute == "engine" and scaled:
    with OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=1.0,
                                                             max_len=len(prof_stream) + 8,
                                                             dtype=dtype)) as e:
      e.warmup()
      e.prefill(prof_stream[:FLAGS.prompt_len])
      for t in prof_stream[FLAGS.prompt_len:FLAGS.prompt_len + 48]:
        e.decode_step(t)
      layer_s = e.stats(skip=8)["tpot_median_ms"] * 1e-3 / cfg.num_layers
  links = {spec: (parse_link(spec, expert_bytes=ebytes, layer_compute_s=layer_s)
                  if spec.startswith("scaled") else parse_link(spec, expert_bytes=ebytes))
           for spec in FLAGS.links}

  sampler = SamplerRun(cfg, params, experts, dtype, len(stream) + 8)
  t0 = time.perf_counter()
  sampler.prefill(stream[:FLAGS.prompt_len])
  sampler.decode_step(stream[FLAGS.prompt_len])      # compiles its step
  sampler_compile_s = time.perf_counter() - t0
  mk = lambda pol, link, f, scan=True: make_engine(stack, cfg, params, store, pol, link, stream,
                                                    counts, dtype, f, scan)
  runners = {"sampler": sampler, "all_resident": mk("baseline", links[FLAGS.links[0]], 1.0)}
  if FLAGS.unrolled:   # the same engines with their layers unrolled, in the same rounds
    runners["unrolled/all_resident"] = mk("baseline", links[FLAGS.links[0]], 1.0, False)
  for (spec, link), preset, scan in itertools.product(links.items(), presets,
                                                      (True, False) if FLAGS.unrolled else (True,)):
    runners[(spec, preset) if scan else ("unrolled", spec, preset)] = mk(
        preset, link, FLAGS.cache_fraction, scan)
  print(f"[bench_offload] {runners[(FLAGS.links[0], presets[0])].describe()}", file=sys.stderr)
  t0 = time.time()
  rounds = run_rounds(runners, stream)
  wall = time.time() - t0
  med = {k: float(np.median(v)) for k, v in rounds.items()}
  sampler_ms = med["sampler"]
  resident = runners["all_resident"].stats(skip=FLAGS.warmup_tokens)
  result = {
      "model": desc, "model_type": cfg.model_type, "layers": cfg.num_layers,
      "experts": cfg.num_experts, "top_k": cfg.top_k, "expert_bytes": ebytes,
      "dtype": str(dtype), "store": FLAGS.store, "device": str(jax.devices()[0]),
      "cache_fraction": FLAGS.cache_fraction, "decode_tokens": FLAGS.decode_tokens,
      "warmup_tokens": FLAGS.warmup_tokens, "rounds": len(rounds["sampler"]),
      "tpot": "median over rounds of each round's mean ms per token",
      "lower_bound": LOWER_BOUND,
      "sampler_tpot_ms": sampler_ms, "sampler_tpot_ms_rounds": rounds["sampler"],
      "engine_all_resident_tpot_ms": med["all_resident"],
      "engine_all_resident_tpot_ms_rounds": rounds["all_resident"],
      "engine_all_resident_over_sampler": med["all_resident"] / sampler_ms,
      "engine_all_resident_stats": resident,
      # the stream's routing (the router's selections, every expert resident)
      "routing": routing.seen(runners["all_resident"].records[FLAGS.warmup_tokens:], resident,
                              cfg.num_experts).get("stream"),
      "expert_copy_ms": copy_ms, "expert_copy_call_ms": 1e3 * copy["copy_s"],
      "expert_copy_in_loop_ms": 1e3 * copy["copy_in_loop_s"],
      "expert_device_put_ms": 1e3 * copy["device_put_s"],
      "expert_device_put_aliases": copy["device_put_aliases"],
      "scaled_compute": FLAGS.scaled_compute,
      "scaled_link_layer_compute_ms": layer_s and 1e3 * layer_s,    # None: no scaled link
      "layer_step_x_layers_ms": model_layer_s and 1e3 * model_layer_s * cfg.num_layers,
      "bench_wall_s": wall, "links": {},
      "load_s": load_s, "sampler_prefill_and_compile_s": sampler_compile_s,
      "compile_s": {str(k if isinstance(k, str) else "/".join(k)): r.compile_s
                    for k, r in runners.items() if hasattr(r, "compile_s")},
      "memory": {"peak_anon_bytes": watch.sample() and watch.peak_anon,
                 "note": "one process holds every runner at once: compare the peak with the "
                         "sum of the plans' anon_bytes (launch.bench_memory measures each "
                         "run alone)",
                 "plans": plans(cfg, dtype, len(stream) + 8, presets, nbytes)},
  }
  mem = result["memory"]
  mem["sum_of_plans_anon_bytes"] = sum(p["anon_bytes"] * (len(links) if k in presets else 1)
                                       for k, p in mem["plans"].items())
  print(f"load {load_s:.1f} s; compile (decode step): " + ", ".join(
      f"{k} {v:.1f} s" for k, v in result["compile_s"].items()) + f"; peak anonymous RSS "
      f"{mem['peak_anon_bytes'] / 1e9:.2f} GB for all runners at once (their plans sum to "
      f"{mem['sum_of_plans_anon_bytes'] / 1e9:.2f} GB)")
  print(f"sampler (all experts resident, one jitted decode_step per token): {sampler_ms:.3f} "
        f"ms/token; engine all resident: {med['all_resident']:.3f} ms/token "
        f"({med['all_resident'] / sampler_ms:.2f}x sampler); one expert's in-program copy "
        f"({FLAGS.store} store): {copy_ms:.4f} ms")
  for spec, link in links.items():
    rows = preset_rows({p: runners[(spec, p)] for p in presets},
                       {p: rounds[(spec, p)] for p in presets}, rounds["sampler"], link,
                       copy_ms, FLAGS.warmup_tokens)
    result["links"][spec] = dict(
        link=link.describe(), bandwidth_Bps=link.bandwidth_Bps, latency_s=link.latency_s,
        expert_transfer_ms=1e3 * link.transfer_time(ebytes) if link.emulated else copy_ms,
        presets=rows)
    print(table(rows, link.describe(), sampler_ms))
  result["layer_scan"] = {str(k if isinstance(k, str) else "/".join(k)): r.program.scan
                          for k, r in runners.items() if hasattr(r, "program")}
  if FLAGS.unrolled:   # after / before: the scanned engine over the unrolled one, per round
    pairs = {"all_resident": ("all_resident", "unrolled/all_resident")}
    pairs.update({f"{spec}/{p}": ((spec, p), ("unrolled", spec, p)) for spec in links
                  for p in presets})
    result["scan_over_unrolled"] = scan_over_unrolled(pairs, rounds, sampler_ms)
    print("scanned / unrolled engine (ratio of medians): " + ", ".join(
        f"{n} {v['ratio_of_medians']:.3f} (unrolled {v['unrolled_tpot_ms']:.2f} ms)"
        for n, v in result["scan_over_unrolled"].items()))
  first = result["links"][FLAGS.links[0]]
  result["link"], result["presets"] = first["link"], first["presets"]
  result["cpu_kernels"] = cpu_kernel.describe()
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=2, default=float)
  print(f"[bench_offload] wrote {FLAGS.out}", file=sys.stderr)
