"""Train the next-layer router-logit estimators and choose the hybrid layers
(--prefetch=hybrid).

  moejax-train-estimators --model_dir=/path/to/model     # -> /path/to/model-estimators/

Needs the default vectors (moejax-default-vectors).  Records (q_l, quasi logits, true
logits of l+1) pairs on train windows of every corpus domain and on held-out stdlib
windows (shards under --data_dir), trains one estimator per MoE-layer pair
(moejax.estimators.train) on [q_l, the previous token's router probabilities at l+1]
(the default; --noprevious_input: q_l alone; moejax.prefetch.estimator), and marks a pair
*hybrid* (estimator used by the engine) when its held-out drift under the plain quasi
predictor is at least --drift_threshold and the estimator raises held-out recall@k
there.  A third source, `previous` (the layer's own selection at the previous token: no
computation), is measured on the same held-out pairs; `choose_source` takes, per pair,
the source with the highest held-out recall@k.  Resumable at every stage.  Then
`moejax-generate --model_dir=... --policy=quality --prefetch=hybrid`.
"""

from __future__ import annotations

import json
import os

from absl import flags
import numpy as np

from moejax.cli import app as cli
from moejax.cli import flagsets
from moejax.train import corpus

FLAGS = flags.FLAGS
flagsets.model_dir(what="HF-format model folder with tokenizer.json")
flags.DEFINE_string("out", "", "Estimators folder (default: <model_dir>-estimators).")
flags.DEFINE_string("data_dir", "runs/estimator_pairs", "Recorded training pairs (shards) and "
                    "the resumable training checkpoints (kept out of --out, which ships), in a "
                    "subfolder named by the model weights' hash: another model's never resume.")
flags.DEFINE_integer("train_windows", 256, "Training windows of 256 tokens.")
flags.DEFINE_list("domains", list(corpus.DOMAINS),
                  "Corpus domains of the training windows (moejax.train.corpus; held-out windows "
                  "are stdlib either way).")
flags.DEFINE_integer("held_windows", 32, "Held-out stdlib windows.")
flags.DEFINE_integer("hidden", 64, "Estimator hidden width.")
flags.DEFINE_integer("epochs", 8, "Maximum epochs per estimator.")
flagsets.tokens_file()
flags.DEFINE_bool("previous_input", True,
                  "The estimators also take the previous token's router probabilities at the "
                  "predicted layer (moejax.prefetch.estimator); --noprevious_input: q alone.")
flags.DEFINE_float("topk_weight", 0.0,
                   "Weight of the top-k cross-entropy beside the KL loss "
                   "(moejax.estimators.train; 0: KL alone).")
flags.DEFINE_float("drift_threshold", 0.0,
                   "Use an estimator only where held-out drift (1 - exact match) is >= this.")

SEQ = 256   # window length of the recorded pairs


def with_previous(split: dict) -> dict:
  """The pair's rows with the estimator input [q, p_prev] (`moejax.prefetch.estimator`)."""
  from moejax.estimators import data as est_data
  q = np.asarray(split["q"], np.float32)
  return dict(split, q=np.concatenate([q, est_data.previous_probs(split["true"], SEQ)], 1))


def choose_source(drift: float, threshold: float, recall: dict) -> str:
  """The hybrid's source of a layer pair: the highest held-out recall@k among quasi, the
  estimator (only where drift >= threshold) and previous; ties go to the cheaper one
  (quasi, then previous, then the estimator)."""
  cands = ["quasi", "previous"] + (["estimator"] if drift >= threshold else [])
  return max(cands, key=lambda c: (recall[c], -cands.index(c)))


def check_flags():
  for name in ("train_windows", "held_windows", "hidden", "epochs"):
    if FLAGS[name].value < 1:
      raise cli.UsageError(f"--{name} must be >= 1, got {FLAGS[name].value}")
  bad = [d for d in FLAGS.domains if d not in corpus.DOMAINS]
  if bad or not FLAGS.domains:
    raise cli.UsageError(f"--domains: choose from {', '.join(corpus.DOMAINS)}; got "
                         f"{','.join(FLAGS.domains)}")


def main(_):
  check_flags()
  model_dir = cli.model_folder(FLAGS.model_dir)
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from tqdm import tqdm
  from moejax.estimators import data as est_data
  from moejax.estimators.train import EstimatorConfig, train_pair
  from moejax.io.loader import load_model
  from moejax.io.traces import config_hash, file_sha256
  from moejax.prefetch import speculation
  cfg, params, store = load_model(model_dir, dtype=jnp.float32)
  experts = store.to_device(jnp.float32)
  out = FLAGS.out or speculation.estimators_dir(model_dir)
  try:
    vecs = speculation.load_default_vectors(os.path.join(out, "default_vectors"), cfg)
  except (FileNotFoundError, ValueError) as e:
    raise cli.UsageError(f"--out={out}: {e}") from None
  train_stream = est_data.train_stream(model_dir, FLAGS.tokens_file, tuple(FLAGS.domains))
  held_stream = est_data.heldout_python(model_dir, FLAGS.tokens_file)
  try:
    train_wins = est_data.windows(train_stream, FLAGS.train_windows, SEQ)
    held_wins = est_data.windows(held_stream, FLAGS.held_windows, SEQ, shuffle=False)
  except ValueError as e:
    raise cli.UsageError(f"--tokens_file: {e}") from None
  meta = {"config_hash": config_hash(cfg)}
  weights = (file_sha256(os.path.join(model_dir, "model.safetensors")) or
             file_sha256(os.path.join(model_dir, "model.safetensors.index.json")) or
             meta["config_hash"])
  # pairs of other training domains go to their own folder (never resumed as these)
  data_dir = os.path.join(FLAGS.data_dir, weights if tuple(FLAGS.domains) == corpus.DOMAINS
                          else f"{weights}_{'+'.join(FLAGS.domains)}")
  bar = lambda desc, unit="shard": (lambda it: tqdm(it, desc=desc, unit=unit, disable=None))
  tr_dir, he_dir = os.path.join(data_dir, "train"), os.path.join(data_dir, "held")
  est_data.record(cfg, params, experts, vecs, train_wins, tr_dir, meta=meta,
                  progress=bar("record train pairs"))
  est_data.record(cfg, params, experts, vecs, held_wins, he_dir, meta=meta,
                  progress=bar("record held-out pairs"))
  ec = EstimatorConfig(hidden=FLAGS.hidden, epochs=FLAGS.epochs, topk_weight=FLAGS.topk_weight)
  # resumable checkpoints per input and training set-up: another set-up never resumes them
  ckpts = (f"checkpoints_{'prev' if FLAGS.previous_input else 'q'}_h{ec.hidden}"
           f"_tk{ec.topk_weight:g}")
  layers = cfg.moe_layers
  rows, trees = [], []
  for j in range(len(layers) - 1):
    train, held = est_data.load(tr_dir, pair=j), est_data.load(he_dir, pair=j)
    if FLAGS.previous_input:
      train, held = with_previous(train), with_previous(held)
    p, hist = train_pair(cfg, train, held, ec, os.path.join(data_dir, ckpts, f"pair_{j}"),
                         progress=bar(f"estimator {layers[j]}->{layers[j + 1]}", "epoch"))
    base, best = hist[0], min(hist, key=lambda h: h["loss"])
    prev = speculation.previous_token_agreement(cfg, held["true"], seq=SEQ)
    drift = 1.0 - base["exact_match"]
    keys = ("recall_at_k", "exact_match", "mass_covered")
    src = choose_source(drift, FLAGS.drift_threshold,
                        {"quasi": base["recall_at_k"], "estimator": best["recall_at_k"],
                         "previous": prev["recall_at_k"]})
    rows.append({"layer": int(layers[j]), "next_layer": int(layers[j + 1]), "drift": drift,
                 "quasi": {k: base[k] for k in keys}, "estimator": {k: best[k] for k in keys},
                 "previous": {k: prev[k] for k in keys}, "hybrid_source": src,
                 "hybrid_uses_estimator": src == "estimator"})
    trees.append(jax.tree_util.tree_map(np.asarray, p))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(os.path.join(out, "estimators")), {"pairs": trees}, force=True)
  hybrid = [r[r["hybrid_source"]] for r in rows]
  mean = lambda src: float(np.mean([r[src]["recall_at_k"] for r in rows]))
  res = dict(meta, hidden=FLAGS.hidden, topk_weight=FLAGS.topk_weight,
             train_domains=list(FLAGS.domains), train_windows=FLAGS.train_windows,
             drift_threshold=FLAGS.drift_threshold,
             inputs="q+prev" if FLAGS.previous_input else "q", per_layer=rows,
             hybrid_recall_at_k=float(np.mean([h["recall_at_k"] for h in hybrid])),
             quasi_recall_at_k=mean("quasi"), estimator_recall_at_k=mean("estimator"),
             previous_recall_at_k=mean("previous"))
  with open(os.path.join(out, "estimators.json"), "w") as f:
    json.dump(res, f, indent=2)
  print_table(rows, res, out)


def print_table(rows: list, res: dict, out: str):
  print(f"{'pair':<8}{'drift':>8}{'quasi recall':>14}{'est. recall':>13}{'prev. recall':>14}"
        f"{'hybrid':>11}")
  for r in rows:
    print(f"{r['layer']}->{r['next_layer']:<5}{r['drift']:>8.3f}{r['quasi']['recall_at_k']:>14.3f}"
          f"{r['estimator']['recall_at_k']:>13.3f}{r['previous']['recall_at_k']:>14.3f}"
          f"{r['hybrid_source']:>11}")
  print(f"mean recall@k: quasi {res['quasi_recall_at_k']:.3f}, estimator "
        f"{res['estimator_recall_at_k']:.3f}, previous {res['previous_recall_at_k']:.3f}, "
        f"hybrid {res['hybrid_recall_at_k']:.3f}; wrote {out}")


def entry():
  """The console script `moejax-train-estimators`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
