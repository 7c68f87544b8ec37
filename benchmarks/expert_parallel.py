"""Expert parallelism: hit rate and time per token against the device count, one run.

  python -m launch.bench_expert_parallel --out=runs/bench_expert_parallel.json

Sweep (`--link`, default the scaled emulated link, one link per device): at the same
per-device budget (`--cache_fraction`) and policy, 1, 2, 4, 8 devices; held-out stdlib
tokens teacher-forced through one OffloadEngine per device count; per count the union and
per-device hit rates, waited fetches and time per token (the first `--skip_tokens` decode
steps left out).

Overhead (native link, the on-device loop of `generate`): every expert resident on one
device against the same experts spread over 2 and 4 devices (each holding 1/N of them),
greedy, the same tokens; the ratio of times per token is what expert parallelism itself
costs (the shard_map, the psum of each MoE layer).  Per `--overhead_models`: the demo
model, the bench shape (benchmarks/models.py), and `qwen3_layers`: 4 layers of
Qwen3-30B-A3B's shape (hidden 2048, 32/4 heads x 128, top-8 of 768-wide experts; 32
experts a layer instead of 128, which changes what a token reads by nothing but the
router), random bf16 weights.

On a CPU-only machine the devices are host devices (`--xla_force_host_platform_device_count`,
provided here) sharing this machine's cores.  Each setting runs `--rounds` times in rotated
order; its figures are its median round's.  Writes the JSON, a PNG next to it, and a table.
"""

from __future__ import annotations

import os

from absl import app, flags
import numpy as np
from tqdm import tqdm

from moejax.offload import expert_parallel

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder with tokenizer.json.")
flags.DEFINE_string("out", "runs/bench_expert_parallel.json", "JSON results (PNG next to it).")
flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Device counts of the sweep.")
flags.DEFINE_float("cache_fraction", 0.25, "Sweep: share of each layer's experts per device.")
flags.DEFINE_string("policy", "quality", "Sweep: the miss policy.")
flags.DEFINE_string("link", "scaled", "Sweep: link (scaled, native, 'BW,LAT').")
flags.DEFINE_integer("prompt_tokens", 16, "Sweep: prompt of each engine run.")
flags.DEFINE_integer("decode_tokens", 96, "Sweep: teacher-forced decode steps per run.")
flags.DEFINE_integer("skip_tokens", 16, "Sweep: decode steps left out (warm-up).")
flags.DEFINE_list("overhead_devices", ["1", "2", "4"], "Overhead: device counts (all resident "
                  "in the union: each device holds 1/N of the experts).")
flags.DEFINE_list("overhead_models", ["demo", "bench_f32", "qwen3_layers"],
                  "Overhead: models (demo: --model_dir; bench_f32; qwen3_layers).")
flags.DEFINE_integer("overhead_tokens", 64, "Overhead: greedy tokens per run.")
flags.DEFINE_integer("rounds", 3, "Rounds per setting, in rotated order.")


def _tokens(tok):
  from moejax.research.study import streams
  docs = [d for d in streams.documents(tok, humaneval=False) if len(d[2]) > 200]
  return np.concatenate([d[2] for d in docs])[:FLAGS.prompt_tokens + FLAGS.decode_tokens]


def sweep_run(model, link, n: int, tokens) -> dict:
  """One teacher-forced run on n devices at the per-device budget."""
  from moejax.offload.engine import EngineConfig, OffloadEngine
  cfg, params, store = model
  p, m = FLAGS.prompt_tokens, FLAGS.decode_tokens
  with OffloadEngine(cfg, params, store, EngineConfig.make(FLAGS.policy,
                                                           cache_fraction=FLAGS.cache_fraction,
                                                           link=link, max_len=p + m + 1,
                                                           expert_devices=n)) as eng:
    eng.warmup()
    eng.prefill([int(t) for t in tokens[:p]])
    for t in tokens[p:p + m]:
      eng.decode_step(int(t))
    s = eng.stats(skip=FLAGS.skip_tokens)
    return dict(devices=n, tpot_ms=s["tpot_ms"], hit_rate=s["hit_rate"],
                device_hit_rates=s.get("device_hit_rates"),
                fetches_per_token=s["fetches_per_token"],
                wait_ms_per_token=s["wait_ms_per_token"],
                admission_wait_ms_per_token=s["admission_wait_ms_per_token"],
                union_slots=eng.budget.slots, slots_per_device=eng.budget.slots_per_device,
                engine=eng.describe())


def overhead_model(name: str):
  """(cfg, params, store) of an --overhead_models entry."""
  import jax.numpy as jnp
  from benchmarks import models as bench_models
  from moejax.io.loader import init_random, load_model
  from moejax.io.store import ExpertStore
  from moejax.model.config import ModelConfig
  if name == "demo":
    return load_model(FLAGS.model_dir, dtype=jnp.float32)
  if name == "qwen3_layers":
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32000, hidden_size=2048, num_layers=4,
                      num_heads=32, num_kv_heads=4, head_dim=128, num_experts=32, top_k=8,
                      moe_intermediate_size=768, intermediate_size=6144,
                      sparse_layers=(True,) * 4, norm_topk_prob=True, qk_norm="head",
                      max_position_embeddings=4096).validate()
    params, exps = init_random(cfg, seed=0, dtype=jnp.bfloat16)
    return cfg, params, ExpertStore.from_stacked(exps)
  cfg, params, store, _, _ = bench_models.load(name)
  return cfg, params, store


def overhead_run(model, n: int, prompt) -> dict:
  """Greedy tokens in the on-device loop, every expert resident in the union of n."""
  from moejax.model.sampler import SamplingParams
  from moejax.offload.engine import EngineConfig, OffloadEngine
  import jax
  cfg, params, store = model
  m = FLAGS.overhead_tokens
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  with OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=1.0 / n,
                                                           link="native",
                                                           max_len=len(prompt) + m + 1,
                                                           expert_devices=n, dtype=dtype)) as eng:
    eng.warmup()
    sp = SamplingParams(0.0, 1.0, m, ())
    eng.generate(prompt, sp)          # compiles the loop (and the prefill bucket)
    eng.take_records()
    out = eng.generate(prompt, sp)
    s = eng.stats()
    return dict(devices=n, tpot_ms=s["tpot_ms"], hit_rate=s["hit_rate"], tokens=out,
                all_resident=eng.budget.all_resident, engine=eng.describe())


def rounds(settings: list, fn, desc: str) -> dict:
  """fn(setting) for every setting, `--rounds` times in rotated order -> {setting: the
  median-tpot round, with every round's tpot}."""
  runs = {s: [] for s in settings}
  order = [settings[(r + j) % len(settings)] for r in range(FLAGS.rounds)
           for j in range(len(settings))]
  for s in tqdm(order, desc=desc, unit="run"):
    runs[s].append(fn(s))
  out = {}
  for s, rs in runs.items():
    rs = sorted(rs, key=lambda r: r["tpot_ms"])
    out[str(s)] = dict(rs[(len(rs) - 1) // 2], tpot_ms_rounds=[r["tpot_ms"] for r in runs[s]])
  return out


def main(_):
  sweep_n = [int(x) for x in FLAGS.devices]
  over_n = [int(x) for x in FLAGS.overhead_devices]
  expert_parallel.provide_cpu_devices(max(sweep_n + over_n))    # before JAX starts
  import jax
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.io.tokenizer import Tokenizer
  from moejax.kernels import cpu_kernel
  from moejax.offload import calibrate
  from moejax.research.study import runner
  if len(jax.devices()) < max(sweep_n + over_n):
    raise app.UsageError(f"--devices / --overhead_devices need {max(sweep_n + over_n)} "
                         f"devices; {len(jax.devices())} are available")
  model = load_model(FLAGS.model_dir, dtype=jnp.float32)
  cfg, params, store = model
  tokens = _tokens(Tokenizer(FLAGS.model_dir))
  link = calibrate.calibrated_link(FLAGS.link, cfg, params, store, jnp.float32)
  res = dict(model_dir=FLAGS.model_dir, platform=jax.devices()[0].platform,
             cores=os.cpu_count(), link=link.describe(), policy=FLAGS.policy,
             cache_fraction_per_device=FLAGS.cache_fraction,
             load_average_before=os.getloadavg())
  with cpu_kernel.decoding():
    res["sweep"] = rounds(sweep_n, lambda n: sweep_run(model, link, n, tokens), "sweep")
    prompt = [int(t) for t in tokens[:FLAGS.prompt_tokens]]
    res["overhead"] = {}
    for name in FLAGS.overhead_models:
      m = overhead_model(name)
      ov = rounds(over_n, lambda n, m=m: overhead_run(m, n, prompt), f"overhead {name}")
      base = ov[str(over_n[0])]
      ref = base["tokens"]
      for r in ov.values():
        r["tpot_ratio_to_one_device"] = r["tpot_ms"] / base["tpot_ms"]
        r["same_tokens"] = r.pop("tokens") == ref
      res["overhead"][name] = ov
      del m
  res["load_average_after"] = os.getloadavg()
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  runner.save_json(FLAGS.out, res)
  png = os.path.splitext(FLAGS.out)[0] + ".png"
  plot(res, png)
  print(format_table(res))
  print(f"wrote {FLAGS.out} and {png}")


def format_table(res: dict) -> str:
  lines = [f"sweep: {res['policy']}, {100 * res['cache_fraction_per_device']:g}% of the experts "
           f"per device, link {res['link']}",
           f"{'devices':>7}  {'union':>5}  {'hit %':>6}  {'per device %':<32}  "
           f"{'fetches':>7}  {'wait ms':>7}  {'ms/token':>8}"]
  for r in res["sweep"].values():
    per = ", ".join(f"{100 * h:.0f}" for h in r["device_hit_rates"] or [])
    lines.append(f"{r['devices']:>7}  {r['union_slots']:>5}  {100 * r['hit_rate']:>6.1f}  "
                 f"{per:<32}  {r['fetches_per_token']:>7.2f}  {r['wait_ms_per_token']:>7.2f}  "
                 f"{r['tpot_ms']:>8.2f}")
  lines += ["", "overhead: every expert resident in the union (native link, on-device loop)",
            f"{'model':<14}{'devices':>7}  {'ms/token':>8}  {'x 1 device':>10}  "
            f"{'same tokens':>11}"]
  for name, ov in res["overhead"].items():
    for r in ov.values():
      lines.append(f"{name:<14}{r['devices']:>7}  {r['tpot_ms']:>8.3f}  "
                   f"{r['tpot_ratio_to_one_device']:>10.2f}  {str(r['same_tokens']):>11}")
  return "\n".join(lines)


def plot(res: dict, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sw = list(res["sweep"].values())
  n = [r["devices"] for r in sw]
  fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
  ax[0].plot(n, [100 * r["hit_rate"] for r in sw], "o-")
  ax[0].set(xlabel="devices", ylabel="union hit rate (%)", xscale="log", xticks=n,
            xticklabels=n, title=f"{100 * res['cache_fraction_per_device']:g}% of experts per device")
  for name, ov in res["overhead"].items():
    ov = list(ov.values())
    ax[1].plot([r["devices"] for r in ov], [r["tpot_ratio_to_one_device"] for r in ov], "s--",
               label=f"{name}, all resident in the union")
  ax[1].plot(n, [r["tpot_ms"] / sw[0]["tpot_ms"] for r in sw], "o-",
             label=f"demo, {res['policy']} (sweep)")
  ax[1].set(xlabel="devices", ylabel="time per token / one device's", xscale="log", xticks=n,
            xticklabels=n, title=f"on {res['platform']} ({res['cores']} cores)")
  ax[1].legend(fontsize=8)
  for a in ax:
    a.minorticks_off()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

