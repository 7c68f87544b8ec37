"""Replay a router trace under policies, cache sizes and hardware profiles (no model).

  moejax-simulate --trace=runs/trace_demo --out=runs/sim_demo \
      --policies=baseline,quality,speed,host,substitute_all --profiles=rtx3090,h100,gh200 \
      --cache_fractions=0.125,0.25,0.5

Writes OUT/results.json (per policy, cache fraction, batch and profile: counts and the
time model's time per token) and OUT/tpot_vs_mass.png (time per token against
substituted mass, one panel per profile).

--batch=1,2,4,8 decodes B streams of the trace in lockstep (the trace cut into B equal
consecutive streams, each with its own --prefill_tokens prompt), one per-layer step per
batch of tokens sharing each layer's cache (moejax/research/simulator.py); per step the
time model charges the union of the batch's experts and each fetched expert once
(docs/simulator.md in the source repository).  With several values it also writes OUT/batch.png (hit rate,
waited fetches and time per token against B).  Times come from the time model
(moejax/research/timemodel.py) with the profile's roofline for --shape (default: the
named real model whose expert count and top-k the trace has, else the trace's own
model); they are simulated, not measured.

--check_engine also times the real engine here on the trace's first tokens
(needs the model: --model_dir or the trace's model_dir): it calibrates the
`this_machine` profile (all-resident time per layer, host overhead per fetch
layer from a native-link baseline run), then compares the simulated with the
measured time per token of baseline, quality and speed under the scaled link.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import numpy as np
from tqdm import tqdm

from moejax.offload import hardware
from moejax.research import simulator, timemodel
from moejax.io import traces
from moejax.cache import policy as policy_lib
from moejax.offload.hardware import moe_layer_bytes
from moejax.cli import app as cli
from moejax import extras

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "Trace folder written by moejax-trace.", required=True)
flags.DEFINE_string("out", None, "Output folder (results.json, PNG).", required=True)
flags.DEFINE_list("policies", ["baseline", "quality", "speed", "host", "substitute_all"],
                  "Presets or miss rules (moejax.cache.policy).")
flags.DEFINE_list("profiles", ["rtx3090", "rtx4090", "a100", "h100", "h200", "gh200"],
                  "Hardware profiles (moejax/offload/hardware.py); NAMExN: N of NAME's GPUs "
                  "expert-parallel (--cache_fractions per GPU, e.g. rtx3090x4); this_machine "
                  "needs --calibration or --check_engine.")
flags.DEFINE_list("cache_fractions", ["0.25"], "Experts per layer resident.")
flags.DEFINE_string("shape", "auto", "Model shape for the roofline: auto, trace, or one of "
                    + ", ".join(hardware.MODELS))
flags.DEFINE_integer("max_tokens", 0, "Replay only the first N tokens (0 = all).")
flags.DEFINE_integer("prefill_tokens", 16, "Leading tokens handled as a prompt (prefill); "
                     "with --batch, of each stream.")
flags.DEFINE_list("batch", ["1"], "Tokens decoded together per step (streams in lockstep "
                  "sharing the cache), e.g. 1,2,4,8.")
flags.DEFINE_enum("initial", "empty", ["empty", "profile"],
                  "Initial cache: empty, or the most-routed experts of the trace.")
flags.DEFINE_string("calibration", None, "JSON of this_machine TimeParams (from --check_engine).")
flags.DEFINE_bool("check_engine", False, "Time the engine here and compare (see docstring).")
flags.DEFINE_string("model_dir", None, "Model for --check_engine (default: the trace's).")
flags.DEFINE_integer("check_tokens", 96, "Decode tokens timed per engine run (--check_engine).")
flags.DEFINE_integer("check_skip", 16, "Untimed decode tokens first (--check_engine).")
flags.DEFINE_string("check_link", "scaled", "Engine --link for the comparison.")
flags.DEFINE_integer("check_repeats", 3, "Engine runs per timing of --check_engine (the "
                     "fastest counts: a busy machine only slows runs down).")


def trace_shape(cfg) -> hardware.ModelShape:
  """The trace's own model as a qwen3_moe-style byte count (bf16)."""
  expert, active = moe_layer_bytes(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.num_experts, cfg.top_k,
                                   cfg.moe_intermediate_size)
  return hardware.ModelShape(f"trace model ({cfg.model_type})", len(cfg.moe_layers),
                             cfg.num_experts, cfg.top_k, expert, active - cfg.top_k * expert,
                             cfg.vocab_size * cfg.hidden_size * 2)


def pick_shape(cfg) -> hardware.ModelShape:
  if FLAGS.shape == "trace":
    return trace_shape(cfg)
  if FLAGS.shape != "auto":
    return hardware.model_shape(FLAGS.shape)
  for m in hardware.MODELS.values():
    if (m.num_experts, m.top_k) == (cfg.num_experts, cfg.top_k):
      return m
  return trace_shape(cfg)


def time_params(names, shape, calibration):
  out = {}
  for n in names:
    if n == hardware.CALIBRATED:
      if calibration is None:
        raise app.UsageError("--profiles=this_machine needs --calibration=FILE.json or "
                             "--check_engine")
      out[n] = timemodel.TimeParams(**calibration)
    else:
      out[n] = timemodel.roofline(hardware.hardware(n), shape)
  return out


def check_engine(tr, out_dir):
  """Calibrates this_machine on the trace's second window, then compares simulated and
  measured time per token of baseline, quality and speed on its first window."""
  import dataclasses
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.offload import calibrate as calibrate_lib
  model_dir = FLAGS.model_dir or tr.meta.get("model_dir")
  cfg, params, store = load_model(model_dir, dtype=jnp.float32)
  prompt, skip = FLAGS.prefill_tokens, FLAGS.check_skip
  n = prompt + skip + FLAGS.check_tokens
  wins = [w for w in tr.windows if w[1] >= n][:2]
  if len(wins) < 2:
    raise app.UsageError(f"--check_engine needs two trace windows of >= {n} tokens")
  link = calibrate_lib.calibrated_link(FLAGS.check_link, cfg, params, store)
  names = ["baseline", "quality", "speed"]
  time_host = "host" in FLAGS.policies and hardware.CALIBRATED in FLAGS.profiles
  simulated = names + (["host"] if time_host else [])

  def segment(w):
    lo = w[0]
    toks = [int(t) for t in tr.token_ids[lo:lo + n]]
    sims = simulator.simulate(tr.cfg, tr.logits_TxLxR[lo:lo + n], simulated,
                              prefill_tokens=prompt)
    return toks, {k: s for k, s in zip(simulated, sims)}

  cal_tokens, cal_steps = segment(wins[1])
  tp = timemodel.calibrate_engine(
      cfg, params, store, cal_tokens, prompt, link,
      {k: s.steps_TxLxC for k, s in cal_steps.items()}, skip=skip,
      time_host=time_host,
      repeats=FLAGS.check_repeats)
  print(f"[check] calibrated: {tp}", file=sys.stderr)
  tokens, sims = segment(wins[0])
  rows = {}
  for name in names:
    meas = timemodel.run_engine(cfg, params, store, name, tokens, prompt, link, skip=skip,
                                repeats=FLAGS.check_repeats)
    s = sims[name]
    sim_ms = timemodel.mean_ms(s.steps_TxLxC, tp, skip)
    rows[name] = dict(measured_tpot_ms=meas["tpot_ms"], simulated_tpot_ms=sim_ms,
                      ratio=sim_ms / meas["tpot_ms"],
                      measured_fetches_per_token=meas["fetches_per_token"],
                      simulated_fetches_per_token=float(
                          np.mean(np.sum(s.steps_TxLxC[skip:, :, 0], axis=1))),
                      measured_admissions_per_token=meas["admissions_per_token"],
                      simulated_admissions_per_token=float(
                          np.mean(np.sum(s.steps_TxLxC[skip:, :, 2], axis=1))))
    print(f"[check] {name:<9} measured {meas['tpot_ms']:7.2f} ms  simulated {sim_ms:7.2f} ms  "
          f"ratio {sim_ms / meas['tpot_ms']:.3f}", file=sys.stderr)
  cal = dataclasses.asdict(tp)
  with open(os.path.join(out_dir, "calibration.json"), "w") as f:
    json.dump(cal, f, indent=1)
  return dict(link=link.describe(), calibration=cal, presets=rows,
              calibration_tokens=[wins[1][0], n], check_tokens=[wins[0][0], n],
              load_average=os.getloadavg(), repeats=FLAGS.check_repeats,
              note="measured: the engine on this machine on the trace's first window; "
                   "simulated: time model with this_machine calibrated on its second window "
                   "(resident, baseline, quality runs)"), cal


def plot(results, path):
  plt = extras.pyplot("the simulator plot")
  profs = list(results["profiles"])
  cols = min(3, len(profs))
  rows = -(-len(profs) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
  for ax in axes.flat[len(profs):]:
    ax.axis("off")
  for ax, prof in zip(axes.flat, profs):
    for pol in results["policies"]:
      pts = [(r["substituted_mass_per_token_layer"], r["time"][prof]["tpot_ms"])
             for r in results["runs"] if r["policy_name"] == pol and prof in r["time"]]
      ax.plot(*zip(*pts), "o-", label=pol)
    ax.set_title(prof, fontsize=9)
    ax.set_xlabel("substituted mass / token-layer")
    ax.set_yscale("log")
  for row in axes:
    row[0].set_ylabel("simulated time per token (ms)")
  axes.flat[0].legend(fontsize=7)
  fig.suptitle(f"SIMULATED: {results['trace']} ({results['shape']}); points: cache fractions "
               f"{', '.join(results['cache_fractions'])}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def batches() -> list[int]:
  """--batch as integers (a usage error names the flag)."""
  try:
    out = [int(b) for b in FLAGS.batch]
  except ValueError:
    out = []
  if not out or min(out) < 1:
    raise app.UsageError(f"--batch: want positive integers, e.g. 1,2,4,8; got "
                         f"{','.join(FLAGS.batch)}")
  if FLAGS.check_engine and out != [1]:
    raise app.UsageError("--check_engine times the engine at --batch=1 only")
  return out


def batch_plot(results, prof, path):
  """Hit rate, waited fetches per token and time per token (profile `prof`) against B,
  one line per policy (the first cache fraction and device count)."""
  plt = extras.pyplot("the simulator's batch plot")
  f0, d0 = float(results["cache_fractions"][0]), results["runs"][0]["devices"]
  fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.0))
  cells = (("hit_rate", "hit rate", 100.0), ("fetches_per_token", "waited fetches / token", 1.0))
  for pol in results["policies"]:
    rs = [r for r in results["runs"] if r["policy_name"] == pol and r["cache_fraction"] == f0
          and r["devices"] == d0]
    bs = [r["batch"] for r in rs]
    for ax, (key, label, scale) in zip(axes, cells):
      ax.plot(bs, [scale * r[key] for r in rs], "o-", label=pol)
      ax.set_ylabel(label + (" %" if scale != 1 else ""), fontsize=8)
    axes[2].plot(bs, [r["time"][prof]["tpot_ms"] for r in rs], "o-", label=pol)
  axes[2].set_ylabel(f"simulated ms / token ({prof})", fontsize=8)
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["batches"], [str(b) for b in results["batches"]])
    ax.set_xlabel("batch B (streams sharing the cache)", fontsize=8)
    ax.tick_params(labelsize=7)
  axes[0].legend(fontsize=7)
  kind = "SYNTHETIC trace " if results.get("synthetic") else ""
  fig.suptitle(f"SIMULATED: {kind}{os.path.basename(results['trace'])} ({results['shape']}), "
               f"{100 * f0:g}% resident", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=80)


def main(_):
  bs = batches()
  os.makedirs(FLAGS.out, exist_ok=True)
  tr = traces.load_trace(FLAGS.trace, max_tokens=FLAGS.max_tokens)
  shape = pick_shape(tr.cfg)
  pols = [policy_lib.make_policy(p) for p in FLAGS.policies]
  results = dict(trace=os.path.abspath(FLAGS.trace), tokens=tr.num_tokens,
                 shape=shape.name, policies=FLAGS.policies, cache_fractions=FLAGS.cache_fractions,
                 batches=bs, synthetic=bool(tr.meta.get("synthetic")),
                 note="times are SIMULATED by the time model, not measured", runs=[])
  calibration = None
  if FLAGS.calibration:
    with open(FLAGS.calibration) as f:
      calibration = json.load(f)
  if FLAGS.check_engine:
    results["engine_check"], calibration = check_engine(tr, FLAGS.out)
  tps = time_params(FLAGS.profiles, shape, calibration)
  results["profiles"] = {k: dict(v.__dict__) for k, v in tps.items()}
  initial = None
  by_devices = {}    # an expert-parallel profile's union cache is its own simulation
  for prof, tp in tps.items():
    by_devices.setdefault(tp.devices, []).append(prof)
  runs = [(float(frac), n, profs, b) for frac in FLAGS.cache_fractions
          for n, profs in by_devices.items() for b in bs]
  seg = lambda b: tr.num_tokens // b - FLAGS.prefill_tokens
  groups = len({simulator.static_key(p) for p in pols})    # one replay per group
  bar = tqdm(total=sum(groups * b * max(seg(b), 0) for *_, b in runs), unit="tok",
             desc="simulate", file=sys.stderr, mininterval=0.5, leave=False)
  for f, n, profs, b in runs:
    if FLAGS.initial == "profile":
      initial = simulator.profile_initial(tr.logits_TxLxR, tr.cfg,
                                          simulator.budget_slots(tr.cfg, f, n).slots)
    if seg(b) <= 0:
      raise app.UsageError(f"--batch={b}: {tr.num_tokens} trace tokens make streams of "
                           f"{tr.num_tokens // b}, not more than --prefill_tokens")
    res = simulator.simulate(tr.cfg, tr.logits_TxLxR, pols, cache_fraction=f, devices=n,
                             initial_LxS=initial, prefill_tokens=FLAGS.prefill_tokens,
                             batch=b, progress=bar.update)
    for name, r in zip(FLAGS.policies, res):
      row = dict(r.summary(), policy_name=name, cache_fraction=f, devices=n, time={})
      low = next(iter(tps.values())).low_ratio       # a low copy's bytes / the expert's
      row["waited_MB_per_token"] = shape.expert_bytes * 1e-6 * (
          row["fetches_per_token"] + low * row["fetches_low_per_token"])
      row["background_MB_per_token"] = shape.expert_bytes * 1e-6 * row["admissions_per_token"]
      for prof in profs:
        tps_s = timemodel.time_per_token(r.steps_TxLxC, tps[prof])    # per step
        row["time"][prof] = dict(tpot_ms=1e3 * float(np.mean(tps_s)) / b,
                                 step_ms=1e3 * float(np.mean(tps_s)),
                                 **timemodel.breakdown(r.steps_TxLxC, tps[prof], b))
      results["runs"].append(row)
  bar.close()
  for r in results["runs"]:
    base = [b for b in results["runs"] if b["cache_fraction"] == r["cache_fraction"]
            and b["devices"] == r["devices"] and b["batch"] == r["batch"]
            and b["policy_name"] == "baseline"]
    for prof in r["time"]:
      r["time"][prof]["speedup_vs_baseline"] = (base[0]["time"][prof]["tpot_ms"] /
                                                r["time"][prof]["tpot_ms"] if base else None)
  with open(os.path.join(FLAGS.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=float)
  plot(results, os.path.join(FLAGS.out, "tpot_vs_mass.png"))
  wrote = "results.json and tpot_vs_mass.png"
  if len(bs) > 1:
    batch_plot(results, list(tps)[0], os.path.join(FLAGS.out, "batch.png"))
    wrote += " and batch.png"
  print(table(results, list(tps)))
  print(f"[simulate] wrote {FLAGS.out}/{wrote}", file=sys.stderr)


def table(results, profs) -> str:
  head = (f"{'policy':<16}{'cache':>6}{'dev':>4}{'B':>3}{'hit %':>7}{'fetch/tok':>10}"
          f"{'fetch/step':>11}{'mass/tl':>8}" + "".join(f"{p[:12]:>14}" for p in profs))
  lines = [f"SIMULATED time per token, ms (x speed-up vs baseline at the same B); shape "
           f"{results['shape']}", head]
  for r in results["runs"]:
    cells = "".join((f"{r['time'][p]['tpot_ms']:>8.2f} "
                     f"({(r['time'][p]['speedup_vs_baseline'] or 0):.1f}x)" if p in r["time"]
                     else "-").rjust(14) for p in profs)
    lines.append(f"{r['policy_name']:<16}{r['cache_fraction']:>6.3g}{r['devices']:>4}"
                 f"{r['batch']:>3}{100 * r['hit_rate']:>7.1f}{r['fetches_per_token']:>10.2f}"
                 f"{r['fetches_per_step']:>11.2f}{r['substituted_mass_per_token_layer']:>8.3f}"
                 + cells)
  return "\n".join(lines)


def entry():
  """The console script `moejax-simulate`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
