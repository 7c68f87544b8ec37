"""moejax against llama.cpp on a model larger than the memory it may use (the seed's claim).

  python -m launch.bench_scale --layers=24 --memory_limit_gb=12 --out=bench_scale.json

The model: `benchmarks.models`' wide model (Qwen3-30B-A3B's layer width: hidden 2048,
128 experts of 768, top-8, vocab 8192, random bf16) with --layers layers (24: 30.0 GB),
written once (--layout fused: stacked per layer, mapped in place by moejax; per_expert:
as published checkpoints, repacked once by moejax into $MOEJAX_CACHE_DIR), and the same
weights as a bf16 GGUF for llama.cpp (the vendored convert_hf_to_gguf.py, which splits
the fused gate_up_proj itself), converted once into --gguf_dir.  Before writing anything
the free disk space is checked (what is missing + an 8 GB reserve; exit 2 if short).

--weights=q4_0 (or q8_0): both contenders read ONE GGUF, the bf16 GGUF requantized once by
llama.cpp (llama-quantize's pure format: every linear, the embeddings and the LM head;
`benchmarks.models.wide_gguf`; 24 layers in q4_0: 8.4 GB); moejax runs it in place
(--model_dir=FILE.gguf: the experts' blocks stay in the mapped file), its plan counts the
blocks.  The limit rule: the cgroup holds the same share of the model as 12 GB of the
30 GB bf16 model, 12 GB x (the format's bytes / bf16's bytes) (`default_limit_gb`;
24 layers in q4_0: 3.38 GB).  Where moejax's plan does not fit that limit at
--cache_fraction the refusal names the largest fraction that does.

  python -m launch.bench_scale --layers=24 --weights=q4_0 --out=bench_scale_q4_0.json

Contenders, each run as a child process in its own v1 memory cgroup whose limit is
--memory_limit_gb (GB = 1e9 bytes; anonymous memory and page cache together, so a
mapped model's pages compete with the process's own), after the page cache is dropped:
  llama.cpp  `llama_timer` (benchmarks/llama_timer.cpp, the C API, --threads threads): the
             GGUF is mmapped (--no_repack: no Q4_0/Q8_0 copies in RAM), the page cache is its
             only expert cache; a warm-up (8-token prompt + 4 steps), a --prefill_len
             prefill, then --decode_tokens steps after a --prompt_len prompt.
  quality, speed, baseline  moejax's OffloadEngine with that preset, --store=mmap (the
             routed experts stay in the mapped file), --cache_fraction (25%) of each layer's
             experts copied into slots, native link, bf16 (`--child=moejax`, below):
             load, warmup (compile), a --prompt_len prefill, --warmup_tokens untimed
             steps, then --decode_tokens timed steps.
Both decode the same tokens: the held-out text of benchmarks/stream.py, teacher-forced (the
prompt is its first --prompt_len tokens, decode step i reads token --prompt_len + i; the
ids go to llama_timer in a file), so both read the experts of the same routing, which the
JSON reports (`routing`: the engines' hit rates and misses, and the stream's own LRU hit at
25% and 8-busiest share, from the router's selections in moejax's records).
Reported per contender (median over --rounds, each running every contender in rotated
order): decode and prefill tok/s, disk bytes read per decoded token (/proc/self/io around
the loop), the child's peak RssAnon, the cgroup's peak, OOM kill, decode over llama.cpp's.
moejax's memory plan (`plan_memory(..., store="mmap")`) is reported beside its peak: its
anon_bytes + 1 GB of runtime must fit the limit (else exit 2 before loading anything).
Also in the JSON: model-file bytes still cached after the drop (fincore), moejax's disk
bytes before decoding, the load average.  Needs root and a v1 memory cgroup (else exit 2).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from absl import flags

from benchmarks import routing, stream
from benchmarks.scale_disk import (Files, cached_bytes, disk_shortfall, model_files,
                                   needs_safetensors)
from benchmarks.scale_report import summarize, table
from moejax.cli import app as cli
from moejax.kernels import cpu_kernel

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 24, "Layers of the wide model.")
flags.DEFINE_float("memory_limit_gb", None, "Memory cgroup limit of every contender (GB); "
                   "default: 12 with --weights=bf16, else the same share of the model "
                   "(`default_limit_gb`: 3.38 for 24 layers in q4_0).")
flags.DEFINE_enum("weights", "bf16", ["bf16", "q8_0", "q4_0"], "The model's weights: bf16 "
                  "(safetensors for moejax, a bf16 GGUF for llama.cpp), or one GGUF in "
                  "llama-quantize's pure q8_0 / q4_0 that both contenders read.")
flags.DEFINE_enum("layout", "fused", ["fused", "per_expert"], "Expert layout of the model on disk.")
flags.DEFINE_integer("rounds", 2, "Rounds; each runs every contender once (rotated order).")
flags.DEFINE_bool("no_repack", True, "llama.cpp keeps its weights in the mapped file (llama-cli's "
                  "--no-repack): else it copies Q4_0/Q8_0 weights into RAM, the whole model.")
flags.DEFINE_list("contenders", ["llama.cpp", "quality", "speed", "baseline"], "Who runs.")
flags.DEFINE_string("out", "bench_scale.json", "JSON results file.")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens before the timed decode.")
flags.DEFINE_integer("prefill_len", 16, "llama.cpp's timed prefill length (moejax's is "
                     "--prompt_len).")
flags.DEFINE_integer("decode_tokens", 256, "Tokens timed (teacher-forced).")
flags.DEFINE_integer("warmup_tokens", 0, "moejax: tokens decoded untimed after the prompt "
                     "(they shift the timed ones past llama.cpp's).")
flags.DEFINE_integer("max_len", 512, "moejax: KV length (and the plan's kv_len).")
flags.DEFINE_float("cache_fraction", 0.25, "moejax: share of each layer's experts in slots.")
flags.DEFINE_integer("threads", 2, "llama.cpp threads (on a busy 2-core machine 1 decoded 4.6x "
                     "faster than 2: docs/lab/runs/2026-12-05-engine4/bench_scale.md).")
flags.DEFINE_float("timeout_s", 1800.0, "Per-run time limit.")
flags.DEFINE_string("model_root", None, "Where the wide model is written (default "
                    "benchmarks.models.WIDE_DIR).")
flags.DEFINE_string("gguf_dir", os.path.join(os.path.expanduser("~"), ".cache", "moejax", "gguf"),
                    "Where the GGUF is written.")
flags.DEFINE_string("child", None, "Internal: 'moejax' runs one moejax contender and prints JSON.")
flags.DEFINE_string("model_dir", None, "--child: the model folder.")
flags.DEFINE_string("policy", "quality", "--child: the preset.")

RUNTIME = 10**9              # moejax's runtime beyond the plan's anonymous bytes
GB = 1e9
BF16_LIMIT_GB = 12.0         # the bf16 run's limit: 12 GB (of 30 at 24 layers)


def default_limit_gb(layers: int, weights: str) -> float:
  """--memory_limit_gb's default: 12 GB for bf16; for a block format the same share of the
  model, 12 GB x (its bytes / the bf16 model's bytes), both from the config
  (`benchmarks.models.wide_bytes`): 24 layers in q4_0 (8.44 GB) get 3.38 GB."""
  from benchmarks import models as bench_models
  if weights == "bf16":
    return BF16_LIMIT_GB
  return BF16_LIMIT_GB * bench_models.wide_bytes(layers, weights) / bench_models.wide_bytes(layers)


def child_moejax() -> dict:
  """One moejax run (in the caller's cgroup): one JSON-able dict."""
  import jax.numpy as jnp
  import numpy as np
  from moejax.io.loader import load_model
  from moejax.kernels import cpu_kernel
  from moejax.offload import memory as mem
  from moejax.offload.engine import EngineConfig, OffloadEngine
  from moejax.offload.memory import plan_memory
  out = {"policy": FLAGS.policy, "model_dir": FLAGS.model_dir}
  with mem.AnonWatch(interval_s=0.01) as whole:
    r0, t0 = mem.read_bytes(), time.perf_counter()
    cfg, params, store = load_model(FLAGS.model_dir, dtype=jnp.bfloat16, mmap=True,
                                    progress=False)
    out["load_s"] = time.perf_counter() - t0
    out["load_read_bytes"] = mem.read_bytes() - r0
    out["plan"] = plan_memory(cfg, jnp.bfloat16, store="mmap", cache_fraction=FLAGS.cache_fraction,
                              kv_len=FLAGS.max_len, nbytes=gguf_nbytes(FLAGS.model_dir)).as_dict()
    r0, t0 = mem.read_bytes(), time.perf_counter()
    eng = OffloadEngine(cfg, params, store, EngineConfig.make(FLAGS.policy,
                                                              cache_fraction=FLAGS.cache_fraction,
                                                              link="native", max_len=FLAGS.max_len,
                                                              dtype=jnp.bfloat16))
    out["engine_s"] = time.perf_counter() - t0
    out["engine_read_bytes"] = mem.read_bytes() - r0
    out["anon_after_load_bytes"] = mem.status()["rss_anon"]
    t0 = time.perf_counter()
    eng.warmup(prompt_lengths=(FLAGS.prompt_len,))
    out["compile_s"] = time.perf_counter() - t0
    ids = stream.held_out_ids(tokenizer(FLAGS.model_dir), stream_len())
    prompt, rest = ids[:FLAGS.prompt_len], ids[FLAGS.prompt_len:]
    with cpu_kernel.decoding():
      r0 = mem.read_bytes()
      t0 = time.perf_counter()
      eng.prefill(prompt)
      out["prefill_s"] = time.perf_counter() - t0
      out["prefill_read_bytes"] = mem.read_bytes() - r0
      for tok in rest[:FLAGS.warmup_tokens]:
        eng.decode_step(tok)
      timed = rest[FLAGS.warmup_tokens:FLAGS.warmup_tokens + FLAGS.decode_tokens]
      r0 = mem.read_bytes()
      t0 = time.perf_counter()
      for tok in timed:
        logits = eng.decode_step(tok)
      np.asarray(logits)
      out["decode_s"] = time.perf_counter() - t0
      out["decode_read_bytes"] = mem.read_bytes() - r0
  n = FLAGS.decode_tokens
  out.update(prefill_tok_s=FLAGS.prompt_len / out["prefill_s"], decode_tok_s=n / out["decode_s"],
             decode_tokens=n, decode_read_bytes_per_token=out["decode_read_bytes"] / n,
             peak_anon_bytes=whole.peak_anon, tokens=timed[:16])
  st = eng.stats(skip=FLAGS.warmup_tokens)
  out["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float)) or v is None}
  for k in ("hit_rate", "fetches_per_token", "substituted_call_pct", "misses_per_token"):
    out[k] = st.get(k)
  out["routing"] = routing.seen(eng.records[FLAGS.warmup_tokens:], st, cfg.num_experts)
  return out


def tokenizer(model: str) -> str:
  """The tokenizer.json of a model folder, or the one beside a GGUF file."""
  return os.path.join(os.path.dirname(model) if model.endswith(".gguf") else model,
                      "tokenizer.json")


def gguf_nbytes(model: str):
  """A GGUF file's (dense, expert) bytes as it holds them (the plan's); None for a folder."""
  if not model.endswith(".gguf"):
    return None
  from moejax.io.weights import gguf_file
  return gguf_file.nbytes(gguf_file.tensor_info(model)[0])


def stream_len() -> int:
  """Tokens of the held-out stream both engines read (prompt, warm-up, timed, one spare)."""
  return max(FLAGS.prefill_len, FLAGS.prompt_len + FLAGS.warmup_tokens + FLAGS.decode_tokens + 1)


def plan_needs(layers: int, fraction: float | None = None) -> tuple[dict, int]:
  """moejax's memory plan at this width, in --weights' format (its blocks' bytes), and the
  cgroup limit it needs (bytes)."""
  import jax.numpy as jnp
  from benchmarks import models as bench_models
  from moejax.offload.memory import plan_memory
  plan = plan_memory(bench_models.wide_config(layers), jnp.bfloat16, store="mmap",
                     cache_fraction=fraction or FLAGS.cache_fraction, kv_len=FLAGS.max_len,
                     weights="float" if FLAGS.weights == "bf16" else FLAGS.weights).as_dict()
  return plan, plan["anon_bytes"] + RUNTIME


def fitting_fraction(layers: int, limit: int, plan: dict, needs: int) -> float | None:
  """The largest cache fraction (k / experts, below --cache_fraction's `plan`) whose plan
  fits `limit`: the slots' bytes come off the plan's, then the plan confirms it; None
  when not even top_k experts a layer fit."""
  from benchmarks import models as bench_models
  per_slot = plan["expert_bytes"] * plan["num_moe_layers"]
  k = plan["cache_slots"] - 1 - math.ceil((needs - limit) / per_slot)   # - the scratch row
  while k >= bench_models.wide_config(layers).top_k:
    if plan_needs(layers, k / plan["num_experts"])[1] <= limit:
      return k / plan["num_experts"]
    k -= 1
  return None


def paths(layers: int) -> tuple[str, str]:
  """(the safetensors folder, the GGUF in --weights' format)."""
  from benchmarks import models as bench_models
  root = FLAGS.model_root or bench_models.WIDE_DIR
  d = bench_models.wide_dir(layers, root=root, layout=FLAGS.layout)
  return d, bench_models.wide_gguf_path(layers, FLAGS.weights, root, FLAGS.layout,
                                        FLAGS.gguf_dir)


def files(layers: int) -> Files:
  """This run's model files (`paths`) and formats, from the flags."""
  model_dir, gguf = paths(layers)
  return Files(model_dir=model_dir, gguf=gguf, weights=FLAGS.weights, layout=FLAGS.layout,
               gguf_dir=FLAGS.gguf_dir)


def run_one(name: str, mfiles: Files, bins: dict | None, limit: int) -> dict:
  from benchmarks import memcg
  model_dir, gguf = mfiles.model_dir, mfiles.gguf
  if name == "llama.cpp":
    ids = stream.held_out_ids(tokenizer(model_dir if FLAGS.weights == "bf16" else gguf),
                              stream_len())
    ids_file = stream.write_ids(os.path.join(FLAGS.gguf_dir, "bench_scale_stream.txt"), ids)
    argv = [bins["llama_timer"], gguf, str(FLAGS.threads), str(FLAGS.prefill_len),
            str(FLAGS.prompt_len), str(FLAGS.decode_tokens), ids_file]
  else:
    argv = [sys.executable, "-m", "launch.bench_scale", "--child=moejax",
            f"--model_dir={model_dir if FLAGS.weights == 'bf16' else gguf}", f"--policy={name}",
            f"--prompt_len={FLAGS.prompt_len}",
            f"--decode_tokens={FLAGS.decode_tokens}", f"--warmup_tokens={FLAGS.warmup_tokens}",
            f"--max_len={FLAGS.max_len}", f"--cache_fraction={FLAGS.cache_fraction}"]
  memcg.drop_page_cache()
  cached = cached_bytes(model_files(name, mfiles))
  res = memcg.run(argv, limit, FLAGS.timeout_s, env=dict(
      os.environ, JAX_PLATFORMS="cpu", LLAMA_TIMER_NO_REPACK="1" if FLAGS.no_repack else "0"))
  row = {"returncode": res.returncode, "oom_killed": res.oom_killed, "wall_s": res.wall_s,
         "group_peak_bytes": res.peak_bytes, "peak_anon_bytes": res.peak_anon_bytes,
         "run_read_bytes": res.read_bytes, "cached_at_start_bytes": cached}
  try:
    child = json.loads(res.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    child = None
  if res.returncode != 0 or child is None:
    row["error"] = (res.stderr or res.stdout)[-1500:]
    return row
  if name == "llama.cpp":
    d = child.get("decode_read_bytes", -1)
    child["decode_read_bytes_per_token"] = d / FLAGS.decode_tokens if d >= 0 else None
  else:
    row["child_peak_anon_bytes"] = child.pop("peak_anon_bytes")
  row.update(child)
  return row


def main(argv):
  del argv
  if FLAGS.child == "moejax":
    if not FLAGS.model_dir:
      raise cli.UsageError("--child=moejax needs --model_dir")
    print(json.dumps(child_moejax()))
    return
  if FLAGS.child:
    raise cli.UsageError(f"--child={FLAGS.child}: only 'moejax'")
  from benchmarks import memcg
  why = memcg.available()
  if why:
    print(f"bench_scale: {why}", file=sys.stderr)
    sys.exit(2)
  bad = [c for c in FLAGS.contenders if c != "llama.cpp" and c not in
         ("quality", "speed", "baseline", "host", "substitute_all")]
  if bad:
    raise cli.UsageError(f"--contenders: unknown {', '.join(bad)}")
  limit_gb = FLAGS.memory_limit_gb or default_limit_gb(FLAGS.layers, FLAGS.weights)
  limit = int(limit_gb * GB)
  plan, needs = plan_needs(FLAGS.layers)
  if limit < needs:
    fits = fitting_fraction(FLAGS.layers, limit, plan, needs)
    cli.usage_exit(f"--memory_limit_gb={limit_gb:g} is below what moejax's plan "
                   f"needs ({plan['anon_bytes'] / GB:.2f} GB anonymous + 1 GB runtime): the "
                   f"smallest that works is --memory_limit_gb={math.ceil(needs / 1e8) / 10:g}"
                   + (f" (or --cache_fraction={fits:g} in this limit)" if fits else ""))
  mfiles = files(FLAGS.layers)
  model_dir, gguf = mfiles.model_dir, mfiles.gguf
  short = disk_shortfall(mfiles, FLAGS.layers, plan, "llama.cpp" in FLAGS.contenders)
  if short:
    print(f"bench_scale: {short}", file=sys.stderr)
    sys.exit(2)
  from benchmarks import models as bench_models, llama_cpp
  res = {"layers": FLAGS.layers, "memory_limit_gb": limit_gb, "weights": FLAGS.weights,
         "layout": FLAGS.layout, "model_dir": model_dir, "gguf": gguf,
         "model_bytes": bench_models.wide_bytes(FLAGS.layers, FLAGS.weights),
         "bf16_model_bytes": bench_models.wide_bytes(FLAGS.layers), "rounds": FLAGS.rounds,
         "contenders": list(FLAGS.contenders), "plan": plan, "plan_limit_needs_bytes": needs,
         "cache_fraction": FLAGS.cache_fraction, "prompt_len": FLAGS.prompt_len,
         "prefill_len": FLAGS.prefill_len, "decode_tokens": FLAGS.decode_tokens,
         "warmup_tokens": FLAGS.warmup_tokens, "threads": FLAGS.threads,
         "cpu_count": os.cpu_count(), "cpu_kernels": cpu_kernel.describe(),
         "loadavg_start": os.getloadavg(), "argv": sys.argv}
  t0 = time.perf_counter()
  if needs_safetensors(mfiles):
    bench_models.save_wide(model_dir, layers=FLAGS.layers, layout=FLAGS.layout)
  res["model_write_s"] = time.perf_counter() - t0
  bins = None
  if "llama.cpp" in FLAGS.contenders or FLAGS.weights != "bf16":
    bins = llama_cpp.build()
    t0 = time.perf_counter()   # the bf16 GGUF (llama.cpp's converter), then --weights' own
    made = bench_models.wide_gguf(FLAGS.layers, FLAGS.weights, os.path.dirname(model_dir),
                                  FLAGS.layout, FLAGS.gguf_dir)
    assert made == gguf, (made, gguf)
    res["gguf_convert_s"] = time.perf_counter() - t0
    res["gguf_bytes"] = os.path.getsize(gguf)
  runs = {c: [] for c in FLAGS.contenders}
  n = len(FLAGS.contenders)
  for r in range(FLAGS.rounds):
    for name in FLAGS.contenders[r % n:] + FLAGS.contenders[:r % n]:
      print(f"[bench_scale] round {r + 1}/{FLAGS.rounds}: {name}", file=sys.stderr, flush=True)
      row = run_one(name, mfiles, bins, limit)
      row["round"] = r
      runs[name].append(row)
      print(f"[bench_scale]   {name}: decode {row.get('decode_tok_s')} tok/s, rc "
            f"{row['returncode']}, oom {row['oom_killed']}, {row['wall_s']:.0f} s"
            + (f"; error: {row['error'][-300:]}" if "error" in row else ""),
            file=sys.stderr, flush=True)
      res.update(runs=runs, loadavg_end=os.getloadavg(), summary=summarize(runs))
      with open(FLAGS.out, "w") as f:
        json.dump(res, f, indent=1)
  print(table(res))
  print(f"wrote {FLAGS.out}")
