"""Evaluate a model on held-out CPython stdlib and HumanEval, against a bigram baseline.

  python -m launch.evaluate --model_dir=ckpts/demo --out=eval.json

Reports teacher-forced perplexity (non-overlapping windows of --seq tokens), a
bigram baseline on the same target tokens (trained on the train split, Dirichlet-
smoothed toward the unigram), and per layer the expert load distribution (min
share, normalised entropy) and the mean gate weight by choice rank.
"""

from __future__ import annotations

import functools
import json
import math
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from moejax import data, routing
from moejax.config import ModelConfig
from moejax.loader import load_model
from moejax.model import Transformer
from moejax.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder with tokenizer.json.")
flags.DEFINE_string("out", "eval.json", "JSON results file.")
flags.DEFINE_integer("seq", 256, "Evaluation window length.")
flags.DEFINE_integer("batch", 8, "Windows per forward pass.")
flags.DEFINE_integer("max_tokens", 262144, "Cap on evaluated held-out stdlib tokens (0 = all).")
flags.DEFINE_float("bigram_alpha", 1.0, "Dirichlet smoothing mass toward the unigram, x vocab.")


@functools.partial(jax.jit, static_argnums=(0,))
def _eval_batch(cfg: ModelConfig, params, experts, tokens_BxT1):
  x, y = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  logits, _, rl = Transformer(cfg).apply({"params": params}, x, experts)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  counts, gate_sums = [], []
  for r in rl:
    if r is None:
      continue
    ids, gates, _ = routing.route(cfg, r.reshape(-1, cfg.num_experts))
    counts.append(jnp.bincount(ids.reshape(-1), length=cfg.num_experts))
    gate_sums.append(jnp.sum(gates, axis=0))         # by rank (ids sorted by score)
  return jnp.sum(nll), jnp.stack(counts), jnp.stack(gate_sums)


def windows(stream: np.ndarray, seq: int, max_tokens: int) -> np.ndarray:
  n = (len(stream) - 1) // seq
  if max_tokens:
    n = min(n, max(1, max_tokens // seq))
  return np.stack([stream[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int32)


def model_eval(cfg, params, experts, wins: np.ndarray, batch: int, desc: str):
  nll, count = 0.0, 0
  sel = np.zeros((len(cfg.moe_layers), cfg.num_experts))
  gsum = np.zeros((len(cfg.moe_layers), cfg.top_k))
  for i in tqdm(range(0, len(wins), batch), desc=desc, unit="batch"):
    b = wins[i:i + batch]
    s, c, g = _eval_batch(cfg, params, experts, jnp.asarray(b))
    nll += float(s)
    count += b.shape[0] * (b.shape[1] - 1)
    sel += np.asarray(c)
    gsum += np.asarray(g)
  return nll / count, sel, gsum / (count)


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
                "max_share": float(share.max()), "entropy_norm": float(ent),
                "mean_gate_by_rank": [float(x) for x in gmean[j]]})
  return out


def main(_):
  cfg, params, store = load_model(FLAGS.model_dir, dtype=jnp.float32)
  tok = Tokenizer(FLAGS.model_dir)
  experts = store.to_device(jnp.float32)
  train_txt, held_txt, manifest = data.split_corpus()
  held = data.encode_stream(tok._tok, held_txt)
  he = data.encode_stream(tok._tok, data.humaneval_texts())
  held_w = windows(held, FLAGS.seq, FLAGS.max_tokens)
  he_w = windows(he, FLAGS.seq, 0)

  held_nll, sel, gmean = model_eval(cfg, params, experts, held_w, FLAGS.batch, "held-out stdlib")
  he_nll, _, _ = model_eval(cfg, params, experts, he_w, FLAGS.batch, "HumanEval")
  print("bigram baseline: tokenising the train split ...")
  bigram = Bigram(data.encode_stream(tok._tok, train_txt), cfg.vocab_size, FLAGS.bigram_alpha)
  stats = load_stats(sel, gmean, cfg.moe_layers)
  res = {
      "model_dir": FLAGS.model_dir, "dataset": manifest,
      "heldout_tokens": int(held_w.shape[0] * FLAGS.seq),
      "humaneval_tokens": int(he_w.shape[0] * FLAGS.seq),
      "heldout_ppl": math.exp(held_nll), "humaneval_ppl": math.exp(he_nll),
      "bigram_ppl": math.exp(bigram.nll(held_w)),
      "bigram_humaneval_ppl": math.exp(bigram.nll(he_w)),
      "min_expert_load_share": min(s["min_share"] for s in stats),
      "dead_expert_threshold": 0.25 / cfg.num_experts,
      "layers_with_dead_experts": [s["layer"] for s in stats
                                   if s["min_share"] < 0.25 / cfg.num_experts],
      "per_layer": stats,
  }
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  print(f"{'set':<18}{'model ppl':>12}{'bigram ppl':>12}")
  print(f"{'held-out stdlib':<18}{res['heldout_ppl']:>12.2f}{res['bigram_ppl']:>12.2f}")
  print(f"{'HumanEval':<18}{res['humaneval_ppl']:>12.2f}{res['bigram_humaneval_ppl']:>12.2f}")
  print(f"\n{'layer':<7}{'min share':>10}{'max share':>10}{'entropy':>9}{'g(1st)':>8}{'g(kth)':>8}")
  for s in stats:
    g = s["mean_gate_by_rank"]
    print(f"{s['layer']:<7}{s['min_share']:>10.4f}{s['max_share']:>10.4f}"
          f"{s['entropy_norm']:>9.3f}{g[0]:>8.3f}{g[-1]:>8.3f}")
  print(f"min expert load share {res['min_expert_load_share']:.4f} "
        f"(dead-expert threshold 0.25/E = {res['dead_expert_threshold']:.4f})")
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
