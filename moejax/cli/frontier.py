"""The policies' quality/speed frontier, and the auto-tuned policy for a budget.

  moejax-frontier --model_dir=ckpts/demo --out=runs/frontier
  (ckpts/demo: the demo model of a source checkout, relative to the current folder)

On the quality study's streams (held-out stdlib + HumanEval; even documents for
calibration, odd ones held out): a simulator sweep of the policy grid (threshold tau
x admission beta x eviction, the presets, and the `cost` rule's lambda when the
policy module has it), the exact emulator's perplexity for fetch_all, the thresholds
--taus and the --presets, then per --ppl_budgets the auto-tuned policy (the fastest
whose measured increase meets the budget; checked with the emulator) re-measured on
the held-out streams.  Writes OUT/frontier.json and OUT/frontier.png (perplexity
increase against projected ms per token, Qwen3-30B-A3B shape on the RTX 3090
profile) and prints a table.  Defaults take a few minutes on 2 CPU cores; --full
runs twice the tokens and a finer grid.  See docs/policies.md in the source
repository.

  moejax-frontier --formats=float,q8_0,q4_0 --cache_bytes=3145728 --out=runs/formats

weighs the weight format as a knob under a memory budget instead: each format at the
largest expert cache --cache_bytes holds in its bytes (the demo: bf16 at 25%, Q8_0 at
47%, Q4_0 at 88%), under --format_policies, and picks one per budget (OUT/formats.json).
"""

from __future__ import annotations

import os
import sys

from absl import flags
import jax.numpy as jnp
from tqdm import tqdm

from moejax import extras
from moejax.cache import policy as P
from moejax.cli import app as cli
from moejax.io.loader import load_model
from moejax.io.tokenizer import Tokenizer
from moejax.offload import hardware
from moejax.research import autotune as A
from moejax.research import frontier as F
from moejax.research.study import runner as R

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "Model folder (default: the demo model, "
                    "./ckpts/demo under the current folder: a source checkout has it).")
flags.DEFINE_string("out", None, "Output folder: frontier.json, frontier.png, runs.",
                    required=True)
flags.DEFINE_float("cache_fraction", 0.25, "Share of each layer's experts resident, in (0, 1].")
flags.DEFINE_integer("streams", 16, "Streams per split (vmapped in the emulator).")
flags.DEFINE_integer("max_tokens", None, "Tokens per split over all its streams (default "
                     "4096; --full 8192).")
flags.DEFINE_integer("window", 256, "Attention window: the context resets every N tokens.")
flags.DEFINE_integer("max_doc_tokens", 512, "Documents are cut to this many tokens.")
flags.DEFINE_list("taus", ["0.03", "0.05", "0.1", "0.15", "0.3"],
                  "Threshold taus measured by the emulator (the quality fit's anchors).")
flags.DEFINE_list("presets", ["quality", "speed"], "Presets measured by the emulator "
                  "(baseline is fetch_all with lru: the fetch_all point).")
flags.DEFINE_list("ppl_budgets", ["1.0"], "Perplexity budgets (percent) to auto-tune for.")
flags.DEFINE_float("tpot_budget_ms", None, "Also auto-tune for this projected time per "
                   "token (ms) on --profile.")
flags.DEFINE_string("profile", None, "Hardware profile of --tpot_budget_ms: "
                    + ", ".join(hardware.HARDWARE))
flags.DEFINE_string("shape", hardware.DEFAULT_MODEL, "Model shape of the projected times: "
                    + ", ".join(hardware.MODELS))
flags.DEFINE_list("sweep_taus", [f"{t:g}" for t in A.TAUS], "Threshold taus of the simulator "
                  "sweep (--full: a finer list).")
flags.DEFINE_list("sweep_lams", [f"{v:g}" for v in A.LAMS], "The cost rule's lambdas (ms per "
                  "%% PPL) of the sweep, when the policy module has the cost rule; empty: none.")
flags.DEFINE_list("sweep_low_bits", ["8"], "The cost rule's low-precision copies in the sweep: "
                  "8, 4 or both.")
flags.DEFINE_list("combos", ["lru:none", "lfu:0.5"], "EVICTION:BETA pairs the sweep's rules run "
                  "under (BETA none: no background admission; --full: every pair).")
flags.DEFINE_bool("full", False, "Full size: 8192 tokens per split, the fine grid (more "
                  "taus, betas 0.25-2, every eviction rule).")
flags.DEFINE_bool("heldout", True, "Re-measure fetch_all and the auto choices on the "
                  "held-out streams.")
flags.DEFINE_integer("max_checks", 3, "Emulator checks per auto-tuned budget.")
flags.DEFINE_integer("seed", 0, "Document order seed.")
flags.DEFINE_list("formats", [], "Instead of the policy frontier: weigh these weight formats "
                  "(float, q8_0, q4_0, q4_k, q6_k) under --cache_bytes, each at the largest "
                  "expert cache the budget holds in its bytes, under --format_policies "
                  "(moejax/research/formats.py): the emulator's perplexity against the float "
                  "model and the projected ms a token on --shape; writes OUT/formats.json.")
flags.DEFINE_integer("cache_bytes", None, "With --formats: device memory for the expert "
                     "cache in bytes, over all MoE layers (as moejax-generate's).")
flags.DEFINE_list("format_policies", ["fetch_all", "quality"], "With --formats: the policies "
                  "each format is measured under.")
flags.DEFINE_enum("format_dtype", "bfloat16", ["float32", "bfloat16"], "With --formats: the "
                  "compute dtype, and the float format's bytes per value.")


def config() -> F.Config:
  try:
    taus = tuple(float(t) for t in FLAGS.taus)
    budgets = tuple(float(b) for b in FLAGS.ppl_budgets)
  except ValueError as e:
    raise cli.UsageError(f"--taus / --ppl_budgets: {e}") from None
  for b in budgets:
    if not b > 0:
      raise cli.UsageError(f"--ppl_budgets: each budget must be > 0 (percent), got {b:g}")
  if FLAGS.tpot_budget_ms is not None and FLAGS.profile is None:
    raise cli.UsageError(f"--tpot_budget_ms needs --profile (one of "
                         f"{', '.join(hardware.HARDWARE)})")
  if FLAGS.profile is not None and FLAGS.profile not in hardware.HARDWARE:
    raise cli.UsageError(f"--profile: unknown {FLAGS.profile!r}; known: "
                         f"{', '.join(hardware.HARDWARE)}")
  if FLAGS.shape not in hardware.MODELS:
    raise cli.UsageError(f"--shape: unknown {FLAGS.shape!r}; known: {', '.join(hardware.MODELS)}")
  for p in FLAGS.presets:
    try:
      R.parse_spec(p, "--presets")
    except R.SpecError as e:
      raise cli.UsageError(str(e)) from None
  try:
    sweep_taus = tuple(float(t) for t in FLAGS.sweep_taus)
    lams = tuple(float(v) for v in FLAGS.sweep_lams)
    combos = tuple((e, None if b.lower() == "none" else float(b))
                   for e, _, b in (c.partition(":") for c in FLAGS.combos))
  except ValueError as e:
    raise cli.UsageError(f"--sweep_taus / --sweep_lams / --combos: {e}") from None
  if not FLAGS.sweep_low_bits or any(b not in ("8", "4") for b in FLAGS.sweep_low_bits):
    raise cli.UsageError(f"--sweep_low_bits: 8, 4 or 8,4, got {','.join(FLAGS.sweep_low_bits)}")
  low_bits = tuple(int(b) for b in FLAGS.sweep_low_bits)
  if any(v < 0 for v in lams):
    bad = min(lams)
    raise cli.UsageError(f"--sweep_lams: lambda must be >= 0, got {bad:g} (nearest feasible: 0)")
  try:
    grid = (A.grid(A.TAUS_FULL, A.COMBOS_FULL, extra=("quality", "speed", "first_choice",
                                                      "substitute_all"), low_bits=low_bits)
            if FLAGS.full else A.grid(sweep_taus, combos, lams, (), low_bits=low_bits))
  except P.PolicyError as e:
    raise cli.UsageError(str(e)) from None
  return F.Config(cache_fraction=FLAGS.cache_fraction, streams=FLAGS.streams,
                  max_tokens=FLAGS.max_tokens or (8192 if FLAGS.full else 4096),
                  window=FLAGS.window, max_doc_tokens=FLAGS.max_doc_tokens, seed=FLAGS.seed,
                  taus=taus, presets=tuple(FLAGS.presets), ppl_budgets=budgets,
                  tpot_budget_ms=FLAGS.tpot_budget_ms, profile=FLAGS.profile,
                  shape=FLAGS.shape, heldout=FLAGS.heldout, max_checks=FLAGS.max_checks,
                  grid=tuple(grid))


def table(res: dict) -> str:
  head = (f"{'policy':<34}{'set':>6}{'dPPL %':>8}{'95% CI':>16}{'waited':>8}"
          f"{'ms/tok':>8}{'speed-up':>9}  pareto")
  lines = [f"fetch_all: perplexity {res['fetch_all']['ppl']:.2f}, "
           f"{res['fetch_all']['waited_bf16_bytes_per_token'] / 1e3:.1f} kB (bf16) waited per "
           f"token; times PROJECTED for {res['shape']} on {res['profile']}", head]
  for q in sorted(res["points"], key=lambda q: (q["heldout"], q["projected_ms_per_token_rtx3090"])):
    lo, hi = q["ppl_increase_ci"]
    lines.append(f"{q['policy'][:33]:<34}{'held' if q['heldout'] else 'cal':>6}"
                 f"{q['ppl_increase_pct']:>+8.2f}{f'[{lo:+.2f}, {hi:+.2f}]':>16}"
                 f"{q['waited_bytes_ratio']:>8.2f}{q['projected_ms_per_token_rtx3090']:>8.2f}"
                 f"{q['projected_speedup_rtx3090']:>8.2f}x  {'*' if q.get('pareto') else ''}")
  for a in res["auto"]:
    held = "n/a" if a["heldout_pct"] is None else f"{a['heldout_pct']:+.2f}%"
    lines.append(f"auto for {A.Budget(**a['budget']).describe()}: {a['policy']} -- predicted "
                 f"{a['predicted_pct']:+.2f}%, calibration {a['calibration_pct']:+.2f}%, "
                 f"held-out {held}, {a['projected_speedup_rtx3090']:.2f}x")
  return "\n".join(lines)


def short(name: str) -> str:
  """A point's label on the plot: tau=0.05, lam=2.3 int8 (+ lfu/admission when not lru)."""
  for a, b in ((" + lru", ""), ("threshold(", "tau="), ("cost(lam=", "lam="), (", int", " int"),
               (")", ""), (" + admission(", " adm ")):
    name = name.replace(a, b)
  return name


def plot(res: dict, path: str):
  plt = extras.pyplot("the frontier plot")
  fig, ax = plt.subplots(figsize=(8, 5))
  sw = [s for s in res["sweep"] if s["policy"] != "fetch_all"]
  ax.scatter([s["projected_ms_per_token"][res["profile"]] for s in sw],
             [s["predicted_ppl_increase_pct"] for s in sw], s=10, c="0.75",
             label="swept (simulator; dPPL predicted from substituted mass)", zorder=1)
  cal = [q for q in res["points"] if not q["heldout"]]
  front = sorted((q for q in cal if q["pareto"]), key=lambda q: q["projected_ms_per_token_rtx3090"])
  ax.plot([q["projected_ms_per_token_rtx3090"] for q in front],
          [q["ppl_increase_pct"] for q in front], "-", c="tab:blue", lw=1, zorder=2,
          label="Pareto frontier (measured)")
  style = dict(fetch_all=("s", "k"), threshold=("o", "tab:blue"), preset=("D", "tab:orange"),
               rule=("v", "tab:purple"), auto=("*", "tab:red"))
  for q in res["points"]:
    mk, col = style[q["role"]]
    x, y = q["projected_ms_per_token_rtx3090"], q["ppl_increase_pct"]
    ax.scatter([x], [y], marker=mk, s=120 if q["role"] == "auto" else 40,
               facecolors="none" if q["heldout"] else col, edgecolors=col, zorder=3)
    name = "fetch_all = baseline" if q["role"] == "fetch_all" else short(q["policy"])
    ax.annotate(name + (" (held-out)" if q["heldout"] else ""), (x, y), fontsize=7,
                xytext=(5, 3) if not q["heldout"] else (5, -11), textcoords="offset points")
  for a in res["auto"]:
    if a["budget"]["ppl_pct"] is not None:
      ax.axhline(a["budget"]["ppl_pct"], ls=":", c="tab:red", lw=0.8)
  ax.set_xlabel(f"projected ms per token ({res['shape']} on {res['profile']}, time model)")
  ax.set_ylabel("perplexity increase over fetch_all (%)")
  ax.set_yscale("symlog", linthresh=0.5, linscale=0.8)
  ax.set_ylim(-0.05, 1.6 * max(q["ppl_increase_pct"] for q in res["points"]) + 0.5)
  ax.set_title("Miss policies: measured perplexity (emulator) vs projected speed; "
               "filled: calibration, hollow: held-out", fontsize=9)
  ax.legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main_formats(c: F.Config, folder: str):
  """--formats: the weight format as a knob under --cache_bytes (formats.table)."""
  from moejax.io.weights import quantized
  from moejax.research import formats
  if not FLAGS.cache_bytes:
    raise cli.UsageError("--formats weighs the formats under a memory budget: give "
                         "--cache_bytes (bytes of expert cache over all MoE layers)")
  for p in FLAGS.format_policies:
    try:
      P.make_policy(p)
    except P.PolicyError as e:
      raise cli.UsageError(f"--format_policies: {e}") from None
  budgets = [A.Budget(ppl_pct=b) for b in c.ppl_budgets]
  if c.tpot_budget_ms is not None:
    budgets.append(A.Budget(tpot_ms=c.tpot_budget_ms, profile=c.profile))
  load = lambda w: load_model(folder, dtype=jnp.dtype(FLAGS.format_dtype), weights=w)
  log = lambda s: print(s, file=sys.stderr, flush=True)
  try:
    res = formats.table(load, Tokenizer(folder), FLAGS.cache_bytes, budgets[0], FLAGS.out,
                        formats=tuple(FLAGS.formats), policies=tuple(FLAGS.format_policies),
                        c=c, dtype=FLAGS.format_dtype, shape=hardware.model_shape(c.shape),
                        log=log)
    choices = [formats.choose(res["rows"], b) for b in budgets]
  except (A.AutoTuneError, quantized.WeightsError) as e:
    raise cli.UsageError(str(e)) from None
  res.update(model_dir=os.path.abspath(folder),
             choices=[dict(ch.row, reason=ch.reason) for ch in choices])
  R.save_json(os.path.join(FLAGS.out, "formats.json"), res)
  print(formats.format_table(res))
  for ch in choices:
    print(f"chose {ch.reason}")
  log(f"[formats] wrote {FLAGS.out}/formats.json in {res['seconds']:.0f} s")


def main(_):
  c = config()
  folder = FLAGS.model_dir or cli.demo_model_dir()
  os.makedirs(FLAGS.out, exist_ok=True)
  if FLAGS.formats:
    return main_formats(c, folder)
  cfg, params, store = load_model(folder, dtype=jnp.float32)
  tok = Tokenizer(folder)
  bar = lambda desc, total: tqdm(total=total, desc=desc, unit="stream", leave=False).update
  log = lambda s: print(s, file=sys.stderr, flush=True)
  try:
    res, _ = F.build(cfg, params, store, tok, c, FLAGS.out, log=log, progress=bar)
  except A.AutoTuneError as e:
    raise cli.UsageError(str(e)) from None
  res["model_dir"] = os.path.abspath(folder)
  R.save_json(os.path.join(FLAGS.out, "frontier.json"), res)
  plot(res, os.path.join(FLAGS.out, "frontier.png"))
  print(table(res))
  log(f"[frontier] wrote {FLAGS.out}/frontier.json and frontier.png in {res['seconds']:.0f} s")


def entry():
  """The console script `moejax-frontier`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
