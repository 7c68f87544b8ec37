"""`python -m launch.bench_memory --records`: the engine's own memory over a long run
whose decode records are never taken (issue 62: it grew 4.2 kB a token).

  python -m launch.bench_memory --records --out=bench_records.json
  python -m launch.bench_memory --records --records_link=native     # the on-device loop

One engine on the demo model (--model_dir, default ckpts/demo) under substitute_all with
admission (--records_admission_beta), 25% of each layer's experts resident, decodes
at least --records_tokens steps, sampled (temperature 1, no stop token), as a run of whole
generations of --records_generation tokens each (the KV cache holds one prompt and its
continuation; one length throughout, so the on-device loop is compiled once, in the first
generation: a shorter last one would compile another, +29 MB at the end);
nothing reads the records until the end.  With the scaled link (the CPU default) each
step is its own dispatch (`decode_step`); with the native link a generation is one
on-device loop.  The process's RssAnon is read after the warm-up and after every
generation.  Writes --out JSON: the samples (decode steps so far, RssAnon bytes), the
growth from the end of the first generation to the end (the first generation's
allocations: compiles, the KV cache's buffers, the kept records filling) and from the
warm-up, the bytes a step, the records kept and the steps `stats()` counts, whether the
engine held glibc's mmap threshold (`moejax.io.heap`; --records_heap=dynamic keeps glibc's
rule, under which the heap grew 8.4 MB steps: a generation's new KV cache and records came
from it) and malloc's own counts at each sample (heap, mapped, in use, free).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from moejax.io import heap

FLAGS = flags.FLAGS
flags.DEFINE_integer("records_tokens", 20000, "With --records: decode steps at least (whole "
                     "generations of --records_generation tokens).",
                     lower_bound=1)
flags.DEFINE_integer("records_generation", 2000, "With --records: new tokens a generation "
                     "(within the demo model's 2048 positions).", lower_bound=2)
flags.DEFINE_string("records_link", "scaled", "With --records: the link (scaled: one "
                    "dispatch a step; native: one on-device loop a generation).")
flags.DEFINE_float("records_admission_beta", 0.5, "With --records: substitute_all's "
                   "admission threshold.")
flags.DEFINE_enum("records_heap", "held", ["held", "dynamic"], "With --records: glibc's mmap "
                  "threshold as the engine holds it (moejax.io.heap), or glibc's dynamic rule "
                  "kept (the comparison: the heap grew 8.4 MB steps).")

PROMPT = "def fibonacci(n):"


def rss_anon_bytes() -> int:
  """This process's RssAnon (anonymous resident memory), in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise OSError("no RssAnon in /proc/self/status (Linux only)")


def build_engine(model_dir: str, prompt_len: int):
  """The engine of the run, warmed up."""
  import jax.numpy as jnp
  from moejax.cache.policy import make_policy
  from moejax.cli import app as cli
  from moejax.io.loader import load_model
  from moejax.model.sampler import bucket
  from moejax.offload import calibrate
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = load_model(model_dir, dtype=jnp.float32)
  limit = cfg.max_position_embeddings
  if prompt_len + FLAGS.records_generation > limit:
    raise cli.UsageError(f"--records_generation={FLAGS.records_generation}: the prompt "
                         f"({prompt_len} tokens) and a generation exceed the model's {limit} "
                         f"positions; give at most {limit - prompt_len}")
  link = calibrate.calibrated_link(FLAGS.records_link, cfg, params, store, jnp.float32)
  policy = make_policy("substitute_all", admission_beta=FLAGS.records_admission_beta)
  max_len = min(limit, bucket(prompt_len + FLAGS.records_generation, minimum=64))
  config = EngineConfig.make(policy, cache_fraction=0.25, link=link, max_len=max_len)
  eng = OffloadEngine(cfg, params, store, config)
  eng.warmup()
  return eng


def decode_run(eng, prompt_ids: list[int]) -> tuple[list, list]:
  """Generations until at least --records_tokens decode steps -> ([(steps so far,
  RssAnon)], [(steps so far, `heap.malloc_info()`)]), the first after the warm-up."""
  from moejax.model.sampler import SamplingParams
  samples, steps, seed = [(0, rss_anon_bytes())], 0, 0
  malloc = [(0, heap.malloc_info())]
  while steps < FLAGS.records_tokens:
    out = eng.generate(prompt_ids, SamplingParams(1.0, 1.0, FLAGS.records_generation, ()),
                       seed=seed)
    steps, seed = steps + len(out) - 1, seed + 1     # the first token: the prompt pass's
    samples.append((steps, rss_anon_bytes()))
    malloc.append((steps, heap.malloc_info()))
    print(f"[bench_memory] {steps} decode steps, RssAnon {samples[-1][1] / 1e6:.1f} MB",
          file=sys.stderr)
  return samples, malloc


def growth(samples: list[tuple[int, int]], start: int) -> dict:
  """RssAnon's growth from samples[start] to the last sample, in all and a step; its
  largest rise above samples[start]; and the least-squares slope over those samples (the
  allocators move RssAnon in steps of MBs: a trend, not one difference, says growth)."""
  import numpy as np
  steps, rss = np.array(samples[start:], np.float64).T
  (s0, b0), (s1, b1) = samples[start], samples[-1]
  slope = float(np.polyfit(steps, rss, 1)[0]) if len(steps) > 2 else None
  return {"from_steps": s0, "to_steps": s1, "bytes": b1 - b0,
          "bytes_per_step": (b1 - b0) / max(1, s1 - s0), "max_rise_bytes": float(rss.max() - b0),
          "fit_bytes_per_step": slope}


def main() -> int:
  from moejax.cli import app as cli
  from moejax.io.tokenizer import Tokenizer
  if FLAGS.records_heap == "dynamic" and not heap.leave_dynamic():
    raise cli.UsageError("--records_heap=dynamic: the mmap threshold is held already")
  model_dir = FLAGS.model_dir or cli.demo_model_dir()
  t0 = time.perf_counter()
  prompt_ids = Tokenizer(model_dir).encode(PROMPT)
  eng = build_engine(model_dir, len(prompt_ids))
  samples, malloc = decode_run(eng, prompt_ids)
  res = {"model_dir": model_dir, "policy": eng.policy.describe(), "link": eng.link.describe(),
         "records_tokens": FLAGS.records_tokens, "generation": FLAGS.records_generation,
         "samples": samples, "after_first_generation": growth(samples, 1),
         "after_warmup": growth(samples, 0), "records_kept": len(eng.records),
         "stats_tokens": eng.stats()["tokens"], "mmap_threshold_held": heap.held(),
         "malloc": malloc,
         "wall_s": time.perf_counter() - t0,
         "loadavg": os.getloadavg()}
  eng.close()
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  g, w = res["after_first_generation"], res["after_warmup"]
  fit = "n/a" if g["fit_bytes_per_step"] is None else f"{g['fit_bytes_per_step']:.0f} B"
  print(f"RssAnon growth over decode steps {g['from_steps']}-{g['to_steps']}: "
        f"{g['bytes'] / 1e6:.2f} MB (largest rise {g['max_rise_bytes'] / 1e6:.2f} MB; fitted "
        f"slope {fit} a step); from the warm-up: {w['bytes'] / 1e6:.2f} MB; "
        f"{res['records_kept']} records kept, stats() counts {res['stats_tokens']} steps; "
        f"mmap threshold held: {res['mmap_threshold_held']}")
  print(f"[bench_memory] wrote {FLAGS.out}", file=sys.stderr)
  return 0
