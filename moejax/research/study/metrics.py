"""Per-policy metrics of an emulation on identical tokens, and the bootstrap over documents."""

from __future__ import annotations

import numpy as np

from moejax.research.emulator import STATS

OFFSET_BINS = (0, 16, 32, 64, 128, 256, 512, 1 << 30)   # tokens since the document start


def summarize_run(out: dict, streams, num_moe_layers: int) -> dict:
  """Per-document sums (for the bootstrap), totals and loss by offset of one run."""
  nd = streams.num_docs
  sc = streams.scored
  nll = np.where(sc, out["nll"], 0.0)
  d = np.where(sc, streams.doc, nd)
  doc_nll = np.bincount(d.ravel(), nll.ravel(), minlength=nd + 1)[:nd]
  doc_n = np.bincount(d.ravel(), minlength=nd + 1)[:nd].astype(np.float64)
  # decoded tokens (the first token of each stream is the prompt): stats [B, T-1, S]
  real = streams.real[:, 1:]
  st = out["stats"] * real[..., None]
  dd = np.where(real, streams.doc[:, 1:], nd)
  doc_sum = lambda name: np.bincount(dd.ravel(), st[..., STATS.index(name)].ravel(),
                                     minlength=nd + 1)[:nd]
  doc_mass = doc_sum("substituted_mass")
  doc_tok = np.bincount(dd.ravel(), minlength=nd + 1)[:nd].astype(np.float64)
  bins = np.digitize(streams.offset, OFFSET_BINS) - 1
  b = np.where(sc, bins, len(OFFSET_BINS) - 1)
  off_nll = np.bincount(b.ravel(), nll.ravel(), minlength=len(OFFSET_BINS))[:-1]
  off_n = np.bincount(b.ravel(), minlength=len(OFFSET_BINS))[:-1].astype(np.float64)
  return dict(doc_nll=doc_nll, doc_n=doc_n, doc_mass=doc_mass, doc_tok=doc_tok,
              doc_recall_hits=doc_sum("recall_hits"), doc_predicted=doc_sum("predicted_calls"),
              totals=st.reshape(-1, st.shape[-1]).sum(0), tokens=float(real.sum()),
              off_nll=off_nll, off_n=off_n, moe_layers=float(num_moe_layers))


def metrics(run: dict, base: dict | None, reps: int = 2000, seed: int = 0) -> dict:
  """ppl, its relative increase over `base` with a bootstrap 95% CI over documents, and
  the decision rates."""
  tot = dict(zip(STATS, run["totals"]))
  calls = max(tot["expert_calls"], 1.0)
  n = run["tokens"]
  nll = run["doc_nll"].sum() / run["doc_n"].sum()
  m = dict(ppl=float(np.exp(nll)), tokens=int(run["doc_n"].sum()),
           hit_rate=tot["hits"] / calls,
           substituted_call_pct=100 * tot["substituted"] / calls,
           dropped_call_pct=100 * tot["dropped"] / calls,
           waited_call_pct=100 * tot["fetches"] / calls,
           host_call_pct=100 * tot["host_calls"] / calls,
           first_choice_substituted_pct=100 * tot["first_substituted"] / max(
               n * run["moe_layers"], 1),
           substituted_mass=tot["substituted_mass"] / max(n * run["moe_layers"], 1),
           substituted_mass_per_token=tot["substituted_mass"] / max(n, 1),
           fetches_per_token=tot["fetches"] / max(n, 1),
           fetches_low_per_token=tot["fetches_low"] / max(n, 1),
           low_mass_per_token=tot["low_mass"] / max(n, 1),
           dropped_mass_per_token=tot["dropped_mass"] / max(n, 1),
           admissions_per_token=tot["admissions"] / max(n, 1),
           admitted_per_token=tot["admitted"] / max(n, 1),
           evictions_per_token=tot["evictions"] / max(n, 1),
           loss_by_offset=(run["off_nll"] / np.maximum(run["off_n"], 1)).tolist())
  if base is not None:
    rel, lo, hi = relative_increase(run, base, reps, seed)
    m.update(ppl_increase_pct=rel, ppl_increase_ci=[lo, hi])
  return m


def relative_increase(run: dict, base: dict, reps: int = 2000, seed: int = 0):
  """100 * (ppl / ppl_base - 1) and its bootstrap 95% CI, resampling documents (paired)."""
  n = run["doc_n"]
  keep = n > 0
  a, b, n = run["doc_nll"][keep], base["doc_nll"][keep], n[keep]
  point = 100 * (np.exp((a.sum() - b.sum()) / n.sum()) - 1)
  rng = np.random.default_rng(seed)
  w = rng.multinomial(len(n), np.full(len(n), 1 / len(n)), size=reps).astype(np.float64)
  boot = 100 * (np.exp((w @ a - w @ b) / (w @ n)) - 1)
  lo, hi = np.percentile(boot, [2.5, 97.5])
  return float(point), float(lo), float(hi)


def per_doc_increase(run: dict, base: dict) -> tuple[np.ndarray, np.ndarray]:
  """Per document: relative ppl increase (%) and mean substituted mass per token-layer."""
  keep = (run["doc_n"] > 0) & (run["doc_tok"] > 0)
  rel = 100 * (np.exp((run["doc_nll"] - base["doc_nll"])[keep] / run["doc_n"][keep]) - 1)
  mass = run["doc_mass"][keep] / (run["doc_tok"][keep] * run["moe_layers"])
  return rel, mass


def pearson(x, y) -> dict:
  """Pearson r with its 95% CI (scipy), or None fields with fewer than 3 points."""
  from moejax import extras
  stats = extras.need("scipy.stats", "study", "Pearson r with its confidence interval")
  x, y = np.asarray(x, float), np.asarray(y, float)
  if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
    return dict(r=None, ci=None, p=None, n=len(x))
  res = stats.pearsonr(x, y)
  ci = res.confidence_interval(0.95)
  return dict(r=float(res.statistic), ci=[float(ci.low), float(ci.high)],
              p=float(res.pvalue), n=len(x))
