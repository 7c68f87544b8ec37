"""Evaluate a model: perplexity per domain, expert load, and routing locality.

  python -m launch.evaluate --model_dir=ckpts/demo --out=eval.json

Reports teacher-forced perplexity (non-overlapping windows of --seq tokens) on the
held-out documents of every corpus domain (moejax.train.corpus: held-out stdlib is the
``python`` domain) and on HumanEval, a bigram baseline on stdlib and HumanEval (trained
on the stdlib train split, Dirichlet-smoothed toward the unigram), per layer the expert
load distribution (min share, normalised entropy) and the mean gate weight by choice
rank, and routing locality (benchmarks.locality): the hit rate of a plain LRU / LFU expert
cache holding 6.25-50% of each layer's experts, in document order and with the same
tokens shuffled.  Writes the JSON and a PNG of the locality curves next to it.
"""

from __future__ import annotations

import functools
import json
import math
import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from moejax.train import corpus, data
from benchmarks import locality
from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.io.loader import load_model
from moejax.model.model import Transformer
from moejax.io.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder with tokenizer.json.")
flags.DEFINE_string("out", "eval.json", "JSON results file.")
flags.DEFINE_integer("seq", 256, "Evaluation window length.")
flags.DEFINE_integer("batch", 8, "Windows per forward pass.")
flags.DEFINE_integer("max_tokens", 262144, "Cap on evaluated held-out stdlib tokens (0 = all).")
flags.DEFINE_float("bigram_alpha", 1.0, "Dirichlet smoothing mass toward the unigram, x vocab.")
flags.DEFINE_integer("domain_tokens", 65536, "Cap on evaluated tokens of the c and english domains.")
flags.DEFINE_integer("locality_tokens", 16384,
                     "Tokens (from the start of each set, document order) for the locality curves.")
flags.DEFINE_bool("bigram", True, "Also fit and report the bigram baseline.")

PUBLISHED = {"source": "llama.cpp PR #27861, 512-expert top-10 model", "lru_hit_rate_12.5": 0.67,
             "lru_hit_rate_25": 0.81}
FRACTIONS = (0.0625, 0.125, 0.25, 0.5)


@functools.partial(jax.jit, static_argnums=(0,))
def _eval_batch(cfg: ModelConfig, params, experts, tokens_BxT1):
  x, y = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  logits, _, rl = Transformer(cfg).apply({"params": params}, x, experts)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  counts, gate_sums, sel = [], [], []
  for r in rl:
    if r is None:
      continue
    ids, gates, _ = routing.route(cfg, r.reshape(-1, cfg.num_experts))
    counts.append(jnp.bincount(ids.reshape(-1), length=cfg.num_experts))
    gate_sums.append(jnp.sum(gates, axis=0))         # by rank (ids sorted by score)
    sel.append(ids.reshape(*x.shape, -1))
  return jnp.sum(nll), jnp.stack(counts), jnp.stack(gate_sums), jnp.stack(sel, 2)


def windows(stream: np.ndarray, seq: int, max_tokens: int) -> np.ndarray:
  n = (len(stream) - 1) // seq
  if max_tokens:
    n = min(n, max(1, max_tokens // seq))
  return np.stack([stream[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int32)


def model_eval(cfg, params, experts, wins: np.ndarray, batch: int, desc: str):
  """Returns (mean NLL, selections [L, E], mean gate by rank [L, K], ids [T, L, K]).

  ids are the router's selections in document order (window after window)."""
  nll, count = 0.0, 0
  sel = np.zeros((len(cfg.moe_layers), cfg.num_experts))
  gsum = np.zeros((len(cfg.moe_layers), cfg.top_k))
  ids = []
  for i in tqdm(range(0, len(wins), batch), desc=desc, unit="batch"):
    b = wins[i:i + batch]
    s, c, g, ids_BxTxLxK = _eval_batch(cfg, params, experts, jnp.asarray(b))
    nll += float(s)
    count += b.shape[0] * (b.shape[1] - 1)
    sel += np.asarray(c)
    gsum += np.asarray(g)
    ids.append(np.asarray(ids_BxTxLxK).reshape(-1, *ids_BxTxLxK.shape[2:]))
  return nll / count, sel, gsum / (count), np.concatenate(ids)


class Bigram:
  """P(b|a) = (c(a,b) + alpha*V*P(b)) / (c(a) + alpha*V), P(b) add-one unigram."""

  def __init__(self, stream: np.ndarray, vocab: int, alpha: float):
    s = stream.astype(np.int64)
    self.v = vocab
    self.uni = (np.bincount(s, minlength=vocab) + 1.0) / (len(s) + vocab)
    codes, counts = np.unique(s[:-1] * vocab + s[1:], return_counts=True)
    self.codes, self.counts = codes, counts
    self.ctx = np.bincount(s[:-1], minlength=vocab).astype(np.float64)
    self.mass = alpha * vocab

  def nll(self, wins: np.ndarray) -> float:
    a = wins[:, :-1].reshape(-1).astype(np.int64)
    b = wins[:, 1:].reshape(-1).astype(np.int64)
    code = a * self.v + b
    pos = np.clip(np.searchsorted(self.codes, code), 0, len(self.codes) - 1)
    c = np.where(self.codes[pos] == code, self.counts[pos], 0)
    p = (c + self.mass * self.uni[b]) / (self.ctx[a] + self.mass)
    return float(-np.mean(np.log(p)))


def load_stats(sel: np.ndarray, gmean: np.ndarray, layers) -> list[dict]:
  out = []
  for j, layer in enumerate(layers):
    share = sel[j] / sel[j].sum()
    ent = -np.sum(share * np.log(np.maximum(share, 1e-30))) / math.log(len(share))
    out.append({"layer": int(layer), "min_share": float(share.min()),
                "dead_experts": int(np.sum(share < 0.1 / len(share))),
                "max_share": float(share.max()), "entropy_norm": float(ent),
                "mean_gate_by_rank": [float(x) for x in gmean[j]]})
  return out


def plot_locality(curves: dict, path: str, title: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.6), squeeze=False)
  for ax, (name, cur) in zip(axes[0], curves.items()):
    for ev, style in (("lru", "-"), ("lfu", "--")):
      xs = [100 * f for f in FRACTIONS]
      ax.plot(xs, [100 * cur[ev][f]["ordered"] for f in FRACTIONS], "o" + style, color="C0",
              label=f"{ev.upper()}, document order")
      ax.plot(xs, [100 * cur[ev][f]["shuffled"] for f in FRACTIONS], "s" + style, color="C1",
              label=f"{ev.upper()}, shuffled")
    ax.plot([12.5, 25], [100 * PUBLISHED["lru_hit_rate_12.5"], 100 * PUBLISHED["lru_hit_rate_25"]],
            "k*", ms=10, label="published (512 experts, top-10)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([6.25, 12.5, 25, 50], ["6.25", "12.5", "25", "50"])
    ax.set_xlabel("experts resident per layer (%)")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(name)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7, loc="lower right")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(_):
  cfg, params, store = load_model(FLAGS.model_dir, dtype=jnp.float32)
  tok = Tokenizer(FLAGS.model_dir)
  experts = store.to_device(jnp.float32)
  parts, manifest = corpus.build()
  sets = {"python": parts["python"][1], "c": parts["c"][1], "english": parts["english"][1],
          "humaneval": data.humaneval_texts()}
  caps = {"python": FLAGS.max_tokens, "c": FLAGS.domain_tokens, "english": FLAGS.domain_tokens,
          "humaneval": 0}
  names = {"python": "held-out stdlib", "c": "held-out C headers",
           "english": "held-out English", "humaneval": "HumanEval"}
  res_sets, wins, curves, sels = {}, {}, {}, {}
  gmean = None
  for key, texts in sets.items():
    stream = data.encode_stream(tok._tok, texts)
    wins[key] = windows(stream, FLAGS.seq, caps[key])
    nll, s_, g_, ids = model_eval(cfg, params, experts, wins[key], FLAGS.batch, names[key])
    sels[key] = s_
    if key == "python":
      gmean = g_
    res_sets[key] = {"tokens": int(wins[key].shape[0] * FLAGS.seq), "ppl": math.exp(nll)}
    curves[names[key]] = locality.locality_curve(ids[:FLAGS.locality_tokens], cfg.num_experts,
                                                 FRACTIONS)
  # expert load over the held-out text of every domain (experts may specialise by domain)
  mix = sels["python"] + sels["c"] + sels["english"]
  stats = load_stats(mix, gmean, cfg.moe_layers)
  per_set_min = {k: float((v / v.sum(1, keepdims=True)).min()) for k, v in sels.items()}
  head = curves["held-out stdlib"]
  res = {
      "model_dir": FLAGS.model_dir, "dataset": manifest,
      "heldout_tokens": res_sets["python"]["tokens"],
      "humaneval_tokens": res_sets["humaneval"]["tokens"],
      "heldout_ppl": res_sets["python"]["ppl"], "humaneval_ppl": res_sets["humaneval"]["ppl"],
      "domain_ppl": {k: v["ppl"] for k, v in res_sets.items()},
      "lru_hit_rate_25": head["lru"][0.25]["ordered"],
      "lru_hit_rate_25_shuffled": head["lru"][0.25]["shuffled"],
      "locality_set": "held-out stdlib", "locality_tokens": FLAGS.locality_tokens,
      "locality": {name: {ev: {str(f): v for f, v in c[ev].items()} for ev in c}
                   for name, c in curves.items()},
      "published": PUBLISHED,
      "min_expert_load_share": min(s["min_share"] for s in stats),
      "load_set": "held-out stdlib + C headers + English (token-capped as above)",
      "min_expert_load_share_per_set": per_set_min,
      "dead_expert_threshold": 0.1 / cfg.num_experts,
      "layers_with_dead_experts": [s["layer"] for s in stats
                                   if s["min_share"] < 0.1 / cfg.num_experts],
      "dead_experts_per_layer": [s["dead_experts"] for s in stats],
      "per_layer": stats,
  }
  if FLAGS.bigram:
    print("bigram baseline: tokenising the stdlib train split ...")
    bigram = Bigram(data.encode_stream(tok._tok, parts["python"][0]), cfg.vocab_size,
                    FLAGS.bigram_alpha)
    res["bigram_ppl"] = math.exp(bigram.nll(wins["python"]))
    res["bigram_humaneval_ppl"] = math.exp(bigram.nll(wins["humaneval"]))
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  png = os.path.splitext(FLAGS.out)[0] + "_locality.png"
  plot_locality(curves, png, f"{FLAGS.model_dir}: plain expert cache on the router's top-{cfg.top_k}")
  print(f"\n{'set':<20}{'tokens':>9}{'model ppl':>11}{'bigram ppl':>12}")
  for key, r in res_sets.items():
    big = {"python": res.get("bigram_ppl"), "humaneval": res.get("bigram_humaneval_ppl")}.get(key)
    print(f"{names[key]:<20}{r['tokens']:>9}{r['ppl']:>11.2f}" + (f"{big:>12.2f}" if big else ""))
  print(f"\nLRU hit rate, first {FLAGS.locality_tokens} tokens (document order / shuffled), %")
  print(f"{'set':<20}" + "".join(f"{100 * f:>14.4g}%" for f in FRACTIONS))
  for name, c in curves.items():
    print(f"{name:<20}" + "".join(f"{100 * c['lru'][f]['ordered']:>8.1f} /{100 * c['lru'][f]['shuffled']:>5.1f}"
                                   for f in FRACTIONS))
  print(f"\n{'layer':<7}{'min share':>10}{'max share':>10}{'dead':>6}{'entropy':>9}{'g(1st)':>8}"
        f"{'g(kth)':>8}")
  for s in stats:
    g = s["mean_gate_by_rank"]
    print(f"{s['layer']:<7}{s['min_share']:>10.4f}{s['max_share']:>10.4f}{s['dead_experts']:>6}"
          f"{s['entropy_norm']:>9.3f}{g[0]:>8.3f}{g[-1]:>8.3f}")
  print("expert load and gates: held-out stdlib + C + English; gates by rank on stdlib")
  print(f"min expert load share {res['min_expert_load_share']:.4f} "
        f"(dead-expert threshold 0.1/E = {res['dead_expert_threshold']:.4f})")
  print(f"wrote {FLAGS.out} and {png}")
