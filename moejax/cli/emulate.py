"""Exact emulation of miss policies on held-out text: perplexity attributed to decisions.

  moejax-emulate --model_dir=ckpts/demo --cache_fraction=0.25 --out=runs/emulate
  (ckpts/demo: the demo model of a source checkout, relative to the current folder)

Teacher-forced over deterministic streams of held-out stdlib files and HumanEval
problems (moejax.research.study.streams), every policy on identical tokens with idealised
(zero-time) transfers.  Writes OUT/results.json, OUT/policies.png and
OUT/mass_vs_ppl.png, and prints a table.  Finished runs are kept in OUT/runs/
(a rerun with the same flags resumes; delete OUT to start over).

Policy specs (--policies): a preset (quality, speed, baseline) or a miss rule
(fetch_all, threshold, first_choice, substitute_all, host, fetch_low, threshold_low,
cost), `threshold:TAU` for another tau, `threshold_low:TAU:TAU_LOW`, `cost:LAMBDA`,
a suffix `@drop` for the drop substitution variant, `@int4` for int4 low-precision
copies (default int8; made once and cached on disk, `moejax.io.quant`), `random:P`
for the control that substitutes each miss with probability P.  fetch_all, the
reference of every relative figure, is always run.  Waited bytes per token count a
full fetch in bf16 and a low-precision one at its own bytes.

--weights=q8_0|q4_0|q4_k|q6_k measures a weight format (`moejax.io.weights.quantized`: the
routed experts and every dense linear quantized once into the cache, as moejax-generate
runs them) and --dtype the compute dtype: the perplexity of fetch_all is then the format's,
to compare with another run's at --weights=float ("Weight formats" of docs/policies.md in the
source repository).
A full fetch of a block store counts its blocks' bytes; the low-precision copies
(fetch_low, threshold_low, `@int4`) are refused there: a fetch already moves the blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import quant
from moejax.io.loader import load_model
from moejax.cache.resident import BudgetError
from moejax.research.study import metrics as M
from moejax.research.study import runner as R
from moejax.research.study import streams as S
from moejax.io.tokenizer import Tokenizer
from moejax.cli import app as cli
from moejax.cli import flagsets
from moejax.io.weights import quantized
from moejax import extras

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder with tokenizer.json "
                    "(the default is relative to the current folder: a source checkout's demo "
                    "model).")
flags.DEFINE_list("policies", ["fetch_all", "quality", "speed", "substitute_all",
                               "first_choice", "threshold:0.05", "threshold:0.1",
                               "threshold:0.15", "threshold:0.2", "threshold:0.3"],
                  "Policy specs (see the module docstring).")
flags.DEFINE_float("cache_fraction", 0.25, "Share of each layer's experts resident, in (0, 1].")
flags.DEFINE_string("out", "runs/emulate", "Output folder.")
flags.DEFINE_integer("max_tokens", 32768, "Tokens over all streams (0: every document).")
flags.DEFINE_integer("streams", 16, "Independent streams (vmapped).")
flags.DEFINE_integer("batch", 1, "Streams decoded together B at a time, sharing each layer's "
                     "expert cache, as a server's batch (--streams a multiple of it).")
flags.DEFINE_integer("window", 256, "Attention window: the context resets every N tokens.")
flags.DEFINE_integer("max_doc_tokens", 1024, "Documents are cut to this many tokens (0: uncut).")
flags.DEFINE_list("sets", ["stdlib", "humaneval"], "Documents: stdlib (held-out) and/or humaneval.")
flags.DEFINE_integer("chunk", 256, "Tokens per scan call (progress, memory).")
flags.DEFINE_integer("seed", 0, "Document order seed.")
flags.DEFINE_integer("bootstrap", 2000, "Bootstrap resamples for the CIs.")
flagsets.dtype()
flagsets.weights()


def check_flags():
  if not 0.0 < FLAGS.cache_fraction <= 1.0:
    raise app.UsageError(f"--cache_fraction must be in (0, 1], got {FLAGS.cache_fraction}")
  bad = [s for s in FLAGS.sets if s not in ("stdlib", "humaneval")]
  if bad or not FLAGS.sets:
    raise app.UsageError(f"--sets: choose from stdlib, humaneval; got {FLAGS.sets}")
  if not FLAGS.policies:
    raise app.UsageError("--policies is empty")
  if FLAGS.batch < 1 or FLAGS.streams % FLAGS.batch:
    raise app.UsageError(f"--batch={FLAGS.batch}: --streams={FLAGS.streams} must be a positive "
                         "multiple of it")
  for n in ("max_tokens", "streams", "window", "chunk"):
    if getattr(FLAGS, n) < (0 if n == "max_tokens" else 1):
      raise app.UsageError(f"--{n} must be positive, got {getattr(FLAGS, n)}")


def make_streams(tok) -> S.Streams:
  docs = S.documents(tok, humaneval="humaneval" in FLAGS.sets, stdlib="stdlib" in FLAGS.sets)
  return S.build(docs, FLAGS.streams, FLAGS.max_tokens, FLAGS.window, FLAGS.seed,
                 FLAGS.max_doc_tokens, round_to=FLAGS.chunk)


def load(model_dir: str):
  """(cfg, params, store) in --weights and --dtype; a format that cannot be made, or a
  policy that fetches low-precision copies of a block store, is a usage error."""
  try:
    cfg, params, store = load_model(model_dir, dtype=jnp.dtype(FLAGS.dtype),
                                    weights=FLAGS.weights)
  except quantized.WeightsError as e:
    raise app.UsageError(str(e)) from None
  return cfg, params, store


def weights_tag() -> str:
  """The runs' file names' part for --weights and --dtype ("" at the defaults, so runs
  made before these flags are reused)."""
  return ((f"_w{FLAGS.weights}" if FLAGS.weights != "float" else "")
          + (f"_{FLAGS.dtype}" if FLAGS.dtype != "float32" else ""))


def full_nbytes(store, shapes: dict) -> int:
  """The bytes a full fetch moves: bf16 rows, or a block store's own blocks."""
  return store.expert_nbytes() if FLAGS.weights != "float" else quant.bf16_nbytes(shapes)


def run_key(spec: str, fraction: float, extra: str = "") -> str:
  """File-safe name of a run: the spec and the budget (plus the streams' hash)."""
  return f"{spec.replace(':', '_').replace('@', '_')}_f{fraction:g}{extra}"


def streams_tag(st: S.Streams) -> str:
  h = hashlib.sha1(st.tokens.tobytes() + st.pos.tobytes()).hexdigest()[:8]
  return f"_s{h}"


def resident_tok_s(cfg, params, store, batch: int, steps: int = 16) -> float:
  """The fully resident model decoding the same batch (moejax Sampler), tokens/s."""
  from moejax.kernels import cpu_kernel
  from moejax.model.sampler import Sampler, SamplingParams
  s = Sampler(cfg, params, store.to_device(jnp.dtype(FLAGS.dtype)), max_len=FLAGS.window + 8)
  _, cache = s.prefill(np.zeros((batch, 1), np.int32))
  tok = jnp.zeros((batch,), jnp.int32)
  sp, key = SamplingParams(), jax.random.PRNGKey(0)
  times = []
  with cpu_kernel.decoding():
    for i in range(steps + 2):
      t0 = time.perf_counter()
      tok, lg, cache = s.decode_step(cache, tok, 1 + i, sp, key)
      jax.block_until_ready(lg)
      times.append(time.perf_counter() - t0)
  return batch / float(np.median(times[2:]))


def plot_policies(res: dict, path: str, title: str):
  plt = extras.pyplot("the mass-vs-perplexity plot")
  pol = res["policies"]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, m in pol.items():
    if "ppl_increase_pct" not in m:
      continue
    x, y = m["substituted_call_pct"] + m["dropped_call_pct"], m["ppl_increase_pct"]
    lo, hi = m["ppl_increase_ci"]
    ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
    ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
  ax.axhline(0, color="gray", lw=0.5)
  ax.set_yscale("symlog", linthresh=10)
  ax.set_xlabel("% of expert calls substituted or dropped")
  ax.set_ylabel("perplexity increase over fetch_all (%), 95% CI")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  check_flags()
  specs = list(dict.fromkeys(["fetch_all"] + [s.strip() for s in FLAGS.policies]))
  parsed = {s: R.parse_spec(s) for s in specs}
  cfg, params, store = load(FLAGS.model_dir)
  from moejax.cache.resident import make_budget
  try:
    budget = make_budget(cfg.num_experts, cfg.top_k, store.expert_nbytes(),
                         len(cfg.moe_layers), fraction=FLAGS.cache_fraction)
  except BudgetError as e:
    raise app.UsageError(str(e)) from None
  tok = Tokenizer(FLAGS.model_dir)
  st = make_streams(tok)
  runner = R.Runner(cfg, params, store, st, FLAGS.out, max_len=FLAGS.window,
                    chunk=FLAGS.chunk, dtype=jnp.dtype(FLAGS.dtype))
  tag = streams_tag(st) + (f"_b{FLAGS.batch}" if FLAGS.batch > 1 else "") + weights_tag()
  print(f"{st.tokens.shape[0]} streams x {st.tokens.shape[1]} tokens, {st.num_docs} documents; "
        f"{budget.describe()}")
  runs, lows = {}, {}
  for s in specs:
    pol = parsed[s][0]
    kw = {"batch": FLAGS.batch} if FLAGS.batch > 1 else {}
    if pol.decision.low:
      bits = pol.decision.low_bits
      if bits not in lows:
        try:
          lows[bits] = quant.load_or_build(store, bits, model_dir=FLAGS.model_dir)
        except quant.QuantError as e:
          raise app.UsageError(f"--policies={s} with --weights={FLAGS.weights}: {e}") from None
      kw["low_store"] = lows[bits]
    runs[s] = runner.run(run_key(s, FLAGS.cache_fraction, tag), *parsed[s],
                         cache_fraction=FLAGS.cache_fraction, **kw)
  base = runs["fetch_all"]
  res = {"model_dir": FLAGS.model_dir, "cache_fraction": FLAGS.cache_fraction,
         "weights": FLAGS.weights, "dtype": FLAGS.dtype, "expert_nbytes": store.expert_nbytes(),
         "budget": budget.as_dict(), "policies": {}, "batch": FLAGS.batch,
         "streams": dict(num_streams=int(st.tokens.shape[0]), length=int(st.tokens.shape[1]),
                         documents=st.num_docs, window=FLAGS.window,
                         max_doc_tokens=FLAGS.max_doc_tokens, sets=FLAGS.sets, seed=FLAGS.seed)}
  shapes = {k: np.shape(v) for k, v in store.get(store.moe_layers[0], 0).items()}
  bf16 = full_nbytes(store, shapes)
  for s in specs:
    m = M.metrics(runs[s], base, FLAGS.bootstrap)
    pol = parsed[s][0]
    m["policy"] = pol.describe() if parsed[s][1] is None else f"control {parsed[s][1]}"
    m["waited_bytes_per_token"] = (m["fetches_per_token"] * bf16 + m["fetches_low_per_token"]
                                   * quant.low_nbytes(shapes, pol.decision.low_bits))
    res["policies"][s] = m
  for m in res["policies"].values():
    m["waited_bytes_ratio"] = m["waited_bytes_per_token"] / max(
        res["policies"]["fetch_all"]["waited_bytes_per_token"], 1e-9)
  prot = [s for s in specs if parsed[s][1] is None and
          parsed[s][0].miss in ("threshold", "first_choice")]
  pr = M.pearson([res["policies"][s]["substituted_mass"] for s in prot],
                 [res["policies"][s]["ppl_increase_pct"] for s in prot])
  res.update(pearson_r=pr["r"], pearson_ci=pr["ci"], pearson_policies=prot,
             tokens=res["policies"]["fetch_all"]["tokens"])
  decoded = sum(runs[s]["decoded"] for s in specs)
  run_s = sum(runs[s]["run_s"] for s in specs)
  res["emulated_tok_s"] = decoded / max(run_s, 1e-9)
  res["compile_s_total"] = sum(runs[s]["compile_s"] for s in specs)
  res["resident_tok_s"] = resident_tok_s(cfg, params, store, st.tokens.shape[0])
  res["note_speed"] = ("emulated_tok_s: decoded tokens per second of the jitted scans over "
                       "all policies, compile excluded; resident_tok_s: the fully resident "
                       "model (Sampler) decoding the same batch, same machine, same run")
  os.makedirs(FLAGS.out, exist_ok=True)
  R.save_json(os.path.join(FLAGS.out, "results.json"), res)
  plot_policies(res, os.path.join(FLAGS.out, "policies.png"),
                f"{os.path.basename(FLAGS.model_dir.rstrip('/'))} ({FLAGS.weights}), "
                f"{100 * FLAGS.cache_fraction:g}% resident, {res['tokens']} tokens")
  print(format_table(res))
  print(f"wrote {os.path.join(FLAGS.out, 'results.json')} and policies.png")


def format_table(res: dict) -> str:
  head = (f"{'policy':<18}{'ppl':>8}{'dPPL %':>8}{'95% CI':>17}{'subst %':>8}{'drop %':>7}"
          f"{'wait %':>7}{'mass':>7}{'hit':>6}{'fetch/t':>8}{'low/t':>7}{'kB/t':>8}{'adm/t':>6}")
  lines = [head]
  for name, m in res["policies"].items():
    ci = m.get("ppl_increase_ci") or [0, 0]
    lines.append(f"{name:<18}{m['ppl']:>8.3f}{m.get('ppl_increase_pct', 0):>8.2f}"
                 f"{f'[{ci[0]:.2f}, {ci[1]:.2f}]':>17}{m['substituted_call_pct']:>8.2f}"
                 f"{m['dropped_call_pct']:>7.2f}{m['waited_call_pct']:>7.2f}"
                 f"{m['substituted_mass']:>7.3f}{m['hit_rate']:>6.2f}"
                 f"{m['fetches_per_token']:>8.2f}{m.get('fetches_low_per_token', 0):>7.2f}"
                 f"{m.get('waited_bytes_per_token', 0) / 1e3:>8.1f}{m['admissions_per_token']:>6.2f}")
  r = res.get("pearson_r")
  lines.append(f"mass vs dPPL over {res.get('pearson_policies')}: Pearson r = "
               f"{'n/a' if r is None else f'{r:.3f}'} CI {res.get('pearson_ci')}")
  lines.append(f"emulated {res['emulated_tok_s']:.0f} tok/s (compile excluded, "
               f"{res['compile_s_total']:.0f} s compiling); resident model "
               f"{res['resident_tok_s']:.0f} tok/s on the same batch")
  return "\n".join(lines)


def entry():
  """The console script `moejax-emulate`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
