"""Default vectors for speculative prefetch (--prefetch=quasi, hybrid): each expert's mean
output, per MoE layer.

  moejax-default-vectors --model_dir=/path/to/model     # -> /path/to/model-estimators/

An offline, teacher-forced pass over training text (non-overlapping windows drawn from
the train split of every corpus domain, moejax.train.corpus, or --tokens_file): D_l[e] =
the mean output of expert e over the tokens routed to it, unweighted by the gate, with
the token count per expert.  Saved with orbax under --out (default:
<model_dir>-estimators/default_vectors) together with meta.json (model config hash,
tokens, windows).  Then `moejax-generate --model_dir=... --policy=quality
--prefetch=quasi`, or `moejax-train-estimators` for --prefetch=hybrid.
"""

from __future__ import annotations

import sys

from absl import flags

from moejax.cli import app as cli
from moejax.cli import flagsets

FLAGS = flags.FLAGS
flagsets.model_dir(what="HF-format model folder with tokenizer.json")
flags.DEFINE_string("out", "", "Output folder (default: <model_dir>-estimators/default_vectors).")
flags.DEFINE_integer("windows", 256, "Training windows to average over.")
flags.DEFINE_integer("seq", 256, "Window length.")
flags.DEFINE_integer("batch", 8, "Windows per jitted pass.")
flags.DEFINE_integer("seed", 0, "Window sampling seed.")
flagsets.tokens_file()


def say(line: str):
  """A progress line on stderr (flushed: the steps before the bars take half a minute)."""
  print(f"[moejax] {line}", file=sys.stderr, flush=True)


def main(_):
  for name in ("windows", "seq", "batch"):
    if FLAGS[name].value < 1:
      raise cli.UsageError(f"--{name} must be >= 1, got {FLAGS[name].value}")
  model_dir = cli.model_folder(FLAGS.model_dir)
  import jax.numpy as jnp
  from tqdm import tqdm
  from moejax.estimators import data as est_data
  from moejax.io.loader import load_model
  from moejax.io.traces import config_hash
  from moejax.prefetch import speculation
  from moejax.train import corpus
  bar = lambda desc, unit: lambda it: tqdm(it, desc=desc, unit=unit, file=sys.stderr,
                                           disable=None)   # a bar on a terminal only
  say(f"loading {model_dir} ...")
  cfg, params, store = load_model(model_dir, dtype=jnp.float32)
  experts = store.to_device(jnp.float32)
  if FLAGS.tokens_file:
    say(f"reading the training tokens of {FLAGS.tokens_file}")
  else:
    say(f"encoding the corpus' train split, domain by domain ({', '.join(corpus.DOMAINS)}; "
        "--tokens_file=FILE.npy skips this)")
  stream = est_data.train_stream(model_dir, FLAGS.tokens_file,
                                 progress=bar("encoding the corpus", "domain"))
  try:
    wins = est_data.windows(stream, FLAGS.windows, FLAGS.seq, FLAGS.seed)
  except ValueError as e:
    raise cli.UsageError(f"--tokens_file / --seq: {e}") from None
  batches = -(-len(wins) // FLAGS.batch)
  say(f"averaging each expert's output over {len(wins)} windows of {FLAGS.seq} tokens, "
      f"{batches} batch{'es' * (batches != 1)} of {FLAGS.batch} (the first compiles the "
      "pass)")
  vecs, counts = speculation.default_vectors(cfg, params, experts, wins, FLAGS.batch,
                                             progress=bar("default vectors", "batch"))
  out = FLAGS.out or speculation.default_vectors_dir(model_dir)
  meta = {"model_dir": model_dir, "config_hash": config_hash(cfg),
          "tokens": int(wins.size), "windows": int(len(wins)), "seq": FLAGS.seq,
          "min_tokens_per_expert": int(min(c.min() for c in counts)),
          "moe_layers": [int(l) for l in cfg.moe_layers]}
  speculation.save_default_vectors(out, vecs, counts, meta)
  print(f"{len(vecs)} MoE layers, {wins.size} tokens; fewest tokens for one expert: "
        f"{meta['min_tokens_per_expert']}; wrote {out}")


def entry():
  """The console script `moejax-default-vectors`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
