"""Default vectors for speculative prefetch: each expert's mean output, per MoE layer.

  python -m launch.default_vectors --model_dir=ckpts/demo

An offline, teacher-forced pass over training text (non-overlapping windows drawn from
the train split of every corpus domain): D_l[e] = the mean output of expert e over the
tokens routed to it, unweighted by the gate, with the token count per expert.  Saved
with orbax under --out (default: <model_dir>-estimators/default_vectors) together with
meta.json (model config hash, tokens, windows).
"""

from __future__ import annotations

import json
import os

from absl import flags
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from launch import cli
from estimators import data as est_data
from moejax.train import data
from moejax.prefetch import speculation
from moejax.io.loader import load_model
from moejax.io.traces import config_hash
from moejax.prefetch.speculation import default_vectors_dir, save_default_vectors

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder with tokenizer.json.")
flags.DEFINE_string("out", "", "Output folder (default: <model_dir>-estimators/default_vectors).")
flags.DEFINE_integer("windows", 256, "Training windows to average over.")
flags.DEFINE_integer("seq", 256, "Window length.")
flags.DEFINE_integer("batch", 8, "Windows per jitted pass.")
flags.DEFINE_integer("seed", 0, "Window sampling seed.")
flags.DEFINE_string("tokens_file", "", "The encoded training stream as .npy (e.g. "
                    "<data_dir>/train_tokens.npy of launch.train_demo, same tokenizer); default: "
                    "encode the corpus' train split (slow).")


def main(_):
  cfg, params, store = load_model(FLAGS.model_dir, dtype=jnp.float32)
  experts = store.to_device(jnp.float32)
  stream = est_data.train_stream(FLAGS.model_dir, FLAGS.tokens_file)
  order = data.window_order(stream.size, FLAGS.seq, FLAGS.seed, epochs=1)[:FLAGS.windows]
  wins = np.stack([stream[i * FLAGS.seq:(i + 1) * FLAGS.seq] for i in order]).astype(np.int32)
  vecs, counts = speculation.default_vectors(
      cfg, params, experts, wins, FLAGS.batch,
      progress=lambda it: tqdm(it, desc="default vectors", unit="batch"))
  out = FLAGS.out or default_vectors_dir(FLAGS.model_dir)
  meta = {"model_dir": FLAGS.model_dir, "config_hash": config_hash(cfg),
          "tokens": int(wins.size), "windows": int(len(wins)), "seq": FLAGS.seq,
          "min_tokens_per_expert": int(min(c.min() for c in counts)),
          "moe_layers": [int(l) for l in cfg.moe_layers]}
  save_default_vectors(out, vecs, counts, meta)
  print(f"{len(vecs)} MoE layers, {wins.size} tokens; fewest tokens for one expert: "
        f"{meta['min_tokens_per_expert']}; wrote {out}")


if __name__ == "__main__":
  cli.run(main)
