"""How well layer l predicts layer l+1's experts, per layer, on held-out text.

  python -m launch.predictors --model_dir=ckpts/demo --out=predictors.json

Predictors (moejax.prefetch.speculation): ``reuse`` = router_{l+1}(Norm_{l+1}(r_l)) and
``quasi`` = router_{l+1}(Norm_{l+1}(r_l + d_l)) with the default vectors made by
launch.default_vectors.  Per layer pair: recall@k, exact top-k match, the true gate
mass the predicted set covers, and drift = 1 - exact match (how often the predicted
top-k differs from the true one).  Writes JSON and a PNG of drift per layer.
"""

from __future__ import annotations

import json
import os

from absl import flags
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from moejax.train import corpus, data
from moejax.prefetch import speculation
from moejax.prefetch.speculation import default_vectors_dir, load_default_vectors
from moejax.io.loader import load_model
from moejax.io.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder with tokenizer.json.")
flags.DEFINE_string("vectors", "", "Default vectors folder (default: <model_dir>-estimators/default_vectors).")
flags.DEFINE_string("out", "predictors.json", "JSON results file (PNG written next to it).")
flags.DEFINE_integer("tokens", 16384, "Held-out stdlib tokens to evaluate.")
flags.DEFINE_integer("seq", 256, "Window length.")
flags.DEFINE_integer("batch", 8, "Windows per jitted pass.")

PREDICTORS = ("reuse", "quasi")


def evaluate(cfg, params, experts, vecs, wins: np.ndarray, batch: int) -> list[dict]:
  """Per layer pair and predictor: the agreement metrics, token-weighted over batches."""
  n_pairs = len(cfg.moe_layers) - 1
  sums = [{p: {"recall_at_k": 0.0, "exact_match": 0.0, "mass_covered": 0.0} for p in PREDICTORS}
          for _ in range(n_pairs)]
  n = 0
  dv = [jnp.asarray(v) for v in vecs]
  for s in tqdm(range(0, len(wins), batch), desc="predictors", unit="batch"):
    b = jnp.asarray(wins[s:s + batch])
    pairs = speculation.predictions(cfg, params, experts, dv, b)
    for j, pr in enumerate(pairs):
      for p in PREDICTORS:
        a = speculation.topk_agreement(cfg, pr["true"], pr[p])
        for k, v in a.items():
          sums[j][p][k] += v * b.size
    n += b.size
  layers = cfg.moe_layers
  return [{"layer": int(layers[j]), "next_layer": int(layers[j + 1]),
           **{p: {k: v / n for k, v in sums[j][p].items()} for p in PREDICTORS}}
          for j in range(n_pairs)]


def plot(rows: list[dict], path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.6))
  xs = [r["layer"] for r in rows]
  for p, m in zip(PREDICTORS, "os"):
    ax.plot(xs, [100 * (1 - r[p]["exact_match"]) for r in rows], m + "-", label=f"{p}: drift")
    ax.plot(xs, [100 * (1 - r[p]["recall_at_k"]) for r in rows], m + "--",
            label=f"{p}: 1 - recall@k")
  ax.set_xlabel("layer l (predicting l+1)")
  ax.set_ylabel("%")
  ax.set_ylim(0, 100)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(_):
  cfg, params, store = load_model(FLAGS.model_dir, dtype=jnp.float32)
  experts = store.to_device(jnp.float32)
  vecs = load_default_vectors(FLAGS.vectors or default_vectors_dir(FLAGS.model_dir), cfg)
  tok = Tokenizer(FLAGS.model_dir)
  parts, _ = corpus.build(["python"])
  stream = data.encode_stream(tok._tok, parts["python"][1])
  n = min(FLAGS.tokens // FLAGS.seq, len(stream) // FLAGS.seq)
  wins = np.stack([stream[i * FLAGS.seq:(i + 1) * FLAGS.seq] for i in range(n)]).astype(np.int32)
  rows = evaluate(cfg, params, experts, vecs, wins, FLAGS.batch)
  res = {"model_dir": FLAGS.model_dir, "tokens": int(wins.size), "set": "held-out stdlib",
         "per_layer": rows,
         "mean": {p: {k: float(np.mean([r[p][k] for r in rows])) for k in rows[0][p]}
                  for p in PREDICTORS}}
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  png = os.path.splitext(FLAGS.out)[0] + "_drift.png"
  plot(rows, png)
  print(f"{'layer':<7}" + "".join(f"{p + ' recall':>14}{p + ' exact':>13}{p + ' mass':>12}"
                                  for p in PREDICTORS))
  for r in rows + [dict(res["mean"], layer="mean")]:
    print(f"{str(r['layer']):<7}" + "".join(
        f"{r[p]['recall_at_k']:>14.3f}{r[p]['exact_match']:>13.3f}{r[p]['mass_covered']:>12.3f}"
        for p in PREDICTORS))
  print(f"wrote {FLAGS.out} and {png}")
