"""Which inputs help the next-layer estimator?  An offline comparison on recorded pairs.

  python -m launch.estimator_inputs --pairs=0,1 --rows=524288 --out=estimator_inputs.json

Trains one estimator per input variant and layer pair on the pairs `launch.train_estimators`
recorded (its --data_dir; the newest recording is taken) and reports held-out recall@k:

  q            the quasi-hidden state alone (train_estimators --noprevious_input)
  q+prev       plus the previous token's router probabilities at layer l+1 (what the
               shipped estimators take: train_estimators' default)
  q+cur        plus layer l's own router probabilities (pairs after the first)
  q+prev+cur   both

The estimator's first layer takes the concatenated inputs (`LogitCorrection` infers its
input width); everything else is `moejax.estimators.train.train_pair`.  A research tool: the
engine's estimators take q or q+prev (`moejax.prefetch.estimator`), not layer l's probabilities.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

from absl import flags
import numpy as np

from moejax.estimators import data as est_data
from moejax.estimators.train import EstimatorConfig, train_pair
from moejax.model.config import ModelConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "The model whose pairs were recorded.")
flags.DEFINE_string("data_dir", "runs/estimator_pairs", "launch.train_estimators --data_dir.")
flags.DEFINE_list("pairs", ["0", "1"], "Layer pairs (0: MoE layers 0 -> 1).")
flags.DEFINE_integer("rows", 524288, "Training rows per pair (0: all recorded).")
flags.DEFINE_integer("hidden", 256, "Estimator hidden width.")
flags.DEFINE_integer("epochs", 6, "Maximum epochs.")
flags.DEFINE_integer("seq", 256, "Window length of the recording (train_estimators.SEQ).")
flags.DEFINE_float("topk_weight", 0.0, "Top-k cross-entropy weight beside the KL loss.")
flags.DEFINE_list("variants", ["q", "q+prev", "q+cur", "q+prev+cur"], "Input variants to train.")
flags.DEFINE_string("out", "estimator_inputs.json", "JSON results file.")

VARIANTS = {"q": ("q",), "q+prev": ("q", "prev"), "q+cur": ("q", "cur"),
            "q+prev+cur": ("q", "prev", "cur")}


def inputs(split: dict, before: dict | None, seq: int) -> dict:
  """The candidate inputs of one pair's rows; `before`: the previous pair's rows (its
  `true` is layer l's own router logits), None for the first pair."""
  out = {"q": np.asarray(split["q"], np.float32),
         "prev": est_data.previous_probs(split["true"], seq)}
  if before is not None:
    t = np.asarray(before["true"], np.float32)
    z = np.exp(t - t.max(-1, keepdims=True))
    out["cur"] = z / z.sum(-1, keepdims=True)
  return out


def compare(cfg, train: dict, held: dict, train_before, held_before, ec: EstimatorConfig,
            seq: int, work_dir: str, variants=tuple(VARIANTS)) -> dict:
  """{variant: held-out metrics of its best epoch, plus "quasi" (no estimator)}."""
  ftr, fhe = inputs(train, train_before, seq), inputs(held, held_before, seq)
  res = {}
  for name, keys in VARIANTS.items():
    if name not in variants or any(k not in ftr for k in keys):
      continue
    tr = dict(train, q=np.concatenate([ftr[k] for k in keys], 1))
    he = dict(held, q=np.concatenate([fhe[k] for k in keys], 1))
    _, hist = train_pair(cfg, tr, he, ec, os.path.join(work_dir, name))
    best = min(hist, key=lambda h: h["loss"])
    res[name] = {k: float(best[k]) for k in ("recall_at_k", "exact_match", "mass_covered")}
    res[name]["epoch"] = int(best["epoch"])
    res[name]["recall_by_epoch"] = [round(float(h["recall_at_k"]), 4) for h in hist]
    res.setdefault("quasi", {k: float(hist[0][k]) for k in ("recall_at_k", "exact_match",
                                                             "mass_covered")})
  return res


def main(_):
  cfg = ModelConfig.from_json_file(os.path.join(FLAGS.model_dir, "config.json"))
  runs = sorted(glob.glob(os.path.join(FLAGS.data_dir, "*", "held")), key=os.path.getmtime)
  if not runs:
    raise SystemExit(f"--data_dir={FLAGS.data_dir}: no recorded pairs; run "
                     f"python -m launch.train_estimators --model_dir={FLAGS.model_dir} first")
  root = os.path.dirname(runs[-1])
  cut = (lambda d: {k: v[:FLAGS.rows] for k, v in d.items()}) if FLAGS.rows else (lambda d: d)
  ec = EstimatorConfig(hidden=FLAGS.hidden, epochs=FLAGS.epochs, topk_weight=FLAGS.topk_weight)
  out = {"data": root, "rows": FLAGS.rows, "hidden": FLAGS.hidden, "epochs": FLAGS.epochs,
         "topk_weight": FLAGS.topk_weight,
         "pairs": {}}
  for j in (int(p) for p in FLAGS.pairs):
    load = lambda split, i: cut(est_data.load(os.path.join(root, split), pair=i))
    before = (lambda split: load(split, j - 1)) if j > 0 else (lambda split: None)
    with tempfile.TemporaryDirectory() as work:
      res = compare(cfg, load("train", j), load("held", j), before("train"), before("held"),
                    ec, FLAGS.seq, work, tuple(FLAGS.variants))
    out["pairs"][j] = res
    for name, r in res.items():
      print(f"pair {j} -> {j + 1}  {name:<12} recall@k {r['recall_at_k']:.3f}  "
            f"exact {r['exact_match']:.3f}  mass {r['mass_covered']:.3f}  "
            f"by epoch {r.get('recall_by_epoch', '')}", flush=True)
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"wrote {FLAGS.out}")
