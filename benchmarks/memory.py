"""Each run alone against the memory plan it prints: peak anonymous RSS vs the plan
(--records: the engine's own growth over a long run instead, benchmarks.record_memory).

  python -m launch.bench_memory --wide_layers=4 --out=bench_memory.json
  python -m launch.bench_memory --wide_layers=4 --memory_limit_gb=4 --runs=quality,speed

Every run is the product's own command line, `python -m launch.generate` on the
real-width model of `benchmarks.models` (Qwen3-30B-A3B's layers, per-expert bf16,
written once; or --model_dir) with `--store=mmap --link=native`, in a child process:

  sampler        no --policy: every expert read where the store holds it
  all_resident   --policy=baseline --cache_fraction=1.0: every expert in the engine's slots
  quality, speed, baseline   the presets at --cache_fraction (0.25)
  PRESET@G       the preset with the host staging tier, --host_cache_gb=G (`io.staging`):
                 --host_cache_gb=0.5,2 adds them for every preset of --runs

--rounds=N runs the list N times in turn (interleaved: runs named NAME#i), so that
timings compare within one period of the machine's load.  Each run's time per token and,
with a staging tier, its staged/disk reads are read from its statistics table.

For each: the plan (`offload.memory.plan_memory`, what `--dry_run` prints) and its
anonymous RAM, the child's sampled peak RssAnon (`offload.memory.AnonWatch`: owned
memory, not the mapped file's pages), whether peak <= plan + --tolerance_gb (1 GB: the runtime's own
memory, jax and XLA's executables), the exit code, whether the kernel killed it for
memory, its wall time, and (with --memory_limit_gb) the memory cgroup's peak, page
cache included (the page cache is dropped before each such run: --drop_caches).  A
table on the terminal and --out JSON.

--memory_limit_gb runs every child in a memory cgroup of that size (`benchmarks.memcg`:
needs root and cgroup v1; without them the reason is printed and the exit is 2).  A
limit below a run's plan + tolerance is refused before anything runs (exit 2, naming
the flag and the smallest limit that works).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from benchmarks import record_memory


FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_memory.json", "JSON results file.")
flags.DEFINE_bool("records", False, "Instead of the runs against their plans: the engine's "
                  "RSS growth over a long run whose records are never taken "
                  "(benchmarks.record_memory; its flags are --records_*).")
flags.DEFINE_string("model_dir", None, "HF folder (default: the wide_bf16 model of "
                    "--wide_layers, written once under ~/.cache/moejax/models).")
flags.DEFINE_integer("wide_layers", 4, "Layers of the wide_bf16 model.")
flags.DEFINE_list("runs", ["sampler", "all_resident", "quality", "speed", "baseline"],
                  "Runs: sampler, all_resident, or presets at --cache_fraction.")
flags.DEFINE_float("cache_fraction", 0.25, "The presets' resident share.")
flags.DEFINE_list("host_cache_gb", [], "Also each preset of --runs with a host staging tier "
                  "of each of these sizes (GB), run as PRESET@G.")
flags.DEFINE_integer("rounds", 1, "Run the list this many times, interleaved.")
flags.DEFINE_float("memory_limit_gb", None, "Run each child in a memory cgroup of this "
                   "size (GB = 10^9 bytes).")
flags.DEFINE_float("tolerance_gb", 1.0, "Allowed peak above the plan's anonymous RAM.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens each run generates.")
flags.DEFINE_integer("timeout_s", 3600, "Per run.")
flags.DEFINE_bool("drop_caches", True, "Drop the page cache before each run (root), so the "
                  "mapped experts are read from disk (and, with --memory_limit_gb, charged "
                  "inside the cgroup; pages cached before would count elsewhere).")


def run_flags(name: str) -> list[str]:
  name, _, g = name.partition("@")
  if g:
    return run_flags(name) + [f"--host_cache_gb={g}"]
  if name == "sampler":
    return []
  if name == "all_resident":
    return ["--policy=baseline", "--cache_fraction=1.0", "--link=native"]
  return [f"--policy={name}", f"--cache_fraction={FLAGS.cache_fraction}", "--link=native"]


def plan_of(cfg, name: str, max_len: int) -> dict:
  import jax.numpy as jnp
  from moejax.offload.memory import plan_memory
  name, _, g = name.partition("@")
  return plan_memory(cfg, jnp.bfloat16, store="mmap", offload=name != "sampler",
                     cache_fraction=1.0 if name == "all_resident" else FLAGS.cache_fraction,
                     kv_len=max_len, host_cache_gb=float(g) if g else None).as_dict()


def decode_figures(stderr: str) -> dict:
  """Time per token and the staging tier's reads from a run's statistics table."""
  import re
  out = {}
  if m := re.search(r"time per token\s+([\d.]+) ms", stderr):
    out["tpot_ms"] = float(m.group(1))
  if m := re.search(r"(\d+) expert reads staged, (\d+) from disk \(([\d.]+) GB in ([\d.]+) "
                    r"s\); hit rate ([\d.]+)%", stderr):
    out.update(staged_reads=int(m.group(1)), disk_reads=int(m.group(2)),
               disk_gb=float(m.group(3)), disk_s=float(m.group(4)),
               staging_hit_rate=float(m.group(5)) / 100)
  return out


def main(_):
  if FLAGS.records:            # the engine's records over a long run (benchmarks.record_memory)
    return record_memory.main()
  from benchmarks import memcg
  from moejax.model.config import ModelConfig
  from moejax.cache.policy import PRESETS
  for name in FLAGS.runs:
    if name.partition("@")[0] not in ("sampler", "all_resident", *PRESETS):
      raise app.UsageError(f"--runs: unknown run {name!r}; choose from sampler, all_resident, "
                           f"{', '.join(PRESETS)} (PRESET@G: with --host_cache_gb=G)")
  runs = list(FLAGS.runs) + [f"{n}@{g}" for n in FLAGS.runs if n in PRESETS
                             for g in FLAGS.host_cache_gb]
  limit = None if FLAGS.memory_limit_gb is None else int(FLAGS.memory_limit_gb * 1e9)
  if limit is not None and (why := memcg.available()):
    print(f"[bench_memory] --memory_limit_gb needs memory cgroups: {why}", file=sys.stderr)
    return 2
  model_dir = FLAGS.model_dir
  if model_dir is None:
    from benchmarks import models as bench_models
    model_dir = bench_models.wide_dir(FLAGS.wide_layers)
  cfg = ModelConfig.from_json_file(model_dir) if os.path.exists(
      os.path.join(model_dir, "config.json")) else None
  if cfg is None:
    from benchmarks import models as bench_models
    cfg = bench_models.wide_config(FLAGS.wide_layers)
  max_len = 64 + FLAGS.max_new_tokens
  plans = {n: plan_of(cfg, n, max_len) for n in runs}
  tol = int(FLAGS.tolerance_gb * 1e9)
  if limit is not None:
    need = max(p["anon_bytes"] for p in plans.values()) + tol
    if limit < need:
      raise app.UsageError(f"--memory_limit_gb={FLAGS.memory_limit_gb:g} is below what the "
                           f"plans need ({need / 1e9:.2f} GB: the largest run's anonymous "
                           f"RAM + --tolerance_gb); use --memory_limit_gb="
                           f"{-(-need // 10**8) / 10:.1f} or more, or fewer --runs")
  if FLAGS.model_dir is None:
    from benchmarks import models as bench_models
    bench_models.save_wide(model_dir, FLAGS.wide_layers)
  # the repack (first --store=mmap load) happens once, outside the measured runs
  from moejax.io.loader import load_model
  import jax.numpy as jnp
  load_model(model_dir, dtype=jnp.bfloat16, mmap=True)
  res = {"model_dir": model_dir, "layers": cfg.num_layers, "memory_limit_bytes": limit,
         "tolerance_bytes": tol, "loadavg_start": os.getloadavg(), "runs": {}}
  order = [(n, f"{n}#{i}" if FLAGS.rounds > 1 else n) for i in range(FLAGS.rounds)
           for n in runs]
  for name, key in order:
    argv = [sys.executable, "-m", "launch.generate", f"--model_dir={model_dir}",
            "--dtype=bfloat16", "--store=mmap", "--nostream",
            "--noprogress", f"--max_new_tokens={FLAGS.max_new_tokens}",
            f"--max_len={max_len}", *run_flags(name)]
    print(f"[bench_memory] {name}: {' '.join(argv[2:])}", file=sys.stderr)
    if FLAGS.drop_caches:
      memcg.drop_page_cache()
    if limit is not None:
      r = memcg.run(argv, limit, FLAGS.timeout_s)
    else:
      r = _run_plain(argv)
    p = plans[name]
    res["runs"][key] = dict(**decode_figures(r.stderr),
        argv=argv[1:], returncode=r.returncode, oom_killed=r.oom_killed, wall_s=r.wall_s,
        plan_anon_bytes=p["anon_bytes"], plan=p, peak_anon_bytes=r.peak_anon_bytes,
        within_plan=(r.peak_anon_bytes is not None
                     and r.peak_anon_bytes <= p["anon_bytes"] + tol),
        group_peak_bytes=r.peak_bytes, disk_read_bytes=r.read_bytes,
        stderr_tail=r.stderr[-1500:])
    res["loadavg_end"] = os.getloadavg()
    with open(FLAGS.out, "w") as f:
      json.dump(res, f, indent=2)
  print(table(res))
  print(f"[bench_memory] wrote {FLAGS.out}", file=sys.stderr)
  return 0 if all(r["returncode"] == 0 for r in res["runs"].values()) else 1


def _run_plain(argv):
  """A child without a cgroup, measured the same way."""
  import resource
  import subprocess
  import threading
  import time
  from benchmarks.memcg import Result
  from moejax.offload import memory as mem
  t0 = time.perf_counter()
  blocks0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
  child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  watch, stop = mem.AnonWatch(pid=str(child.pid)), threading.Event()

  def sample():
    while not stop.wait(0.02):
      watch.sample()
  th = threading.Thread(target=sample, daemon=True)
  th.start()
  out, err = child.communicate(timeout=FLAGS.timeout_s)
  stop.set()
  th.join()
  blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks0
  return Result(child.returncode, False, time.perf_counter() - t0, None, watch.peak_anon,
                512 * blocks, out, err)


def table(res: dict) -> str:
  gb = lambda n: "-" if n is None else f"{n / 1e9:.2f}"
  lines = [f"{'run':<16}{'plan GB':>9}{'peak anon':>11}{'<= plan+tol':>12}{'group GB':>10}"
           f"{'rc':>5}{'OOM':>5}{'wall s':>8}{'ms/tok':>8}{'staged':>8}{'disk':>6}"]
  for name, r in res["runs"].items():
    lines.append(f"{name:<16}{gb(r['plan_anon_bytes']):>9}{gb(r['peak_anon_bytes']):>11}"
                 f"{str(r['within_plan']):>12}{gb(r['group_peak_bytes']):>10}"
                 f"{r['returncode']:>5}{str(r['oom_killed']):>5}{r['wall_s']:>8.1f}"
                 f"{r.get('tpot_ms', float('nan')):>8.1f}{r.get('staged_reads', '-'):>8}"
                 f"{r.get('disk_reads', '-'):>6}")
  return "\n".join(lines)
