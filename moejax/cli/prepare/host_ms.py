"""Time one expert's HOST call on this machine: the figure `moejax-generate --policy=cost
--host_ms=FILE` reads to offer the host option (compute a miss on the CPU).

  moejax-host-ms --model_dir=/path/to/model --out=host_ms.json
  moejax-generate --model_dir=/path/to/model --policy=cost --host_ms=host_ms.json

The engine's HOST branch (moejax.research.host_time) on one token, bf16 experts of the
model's width (--model_dir's config.json; without it --hidden and --inter, default
Qwen3-30B-A3B's 2048 and 768), over a store of --experts experts rotated through so
that each call reads its weights from memory, as a decode step does.  Writes --out
(JSON with "host_ms") and prints the figure.
"""

from __future__ import annotations

import json
import os

from absl import flags

from moejax.cli import app as cli
from moejax.cli import flagsets

FLAGS = flags.FLAGS
flagsets.model_dir(what="A model folder: the experts' width from its config.json (instead of "
                   "--hidden and --inter)", where="--hidden and --inter")
flags.DEFINE_integer("hidden", 2048, "Hidden size D (without --model_dir).", lower_bound=1)
flags.DEFINE_integer("inter", 768, "Expert intermediate size I (without --model_dir).",
                     lower_bound=1)
flags.DEFINE_integer("experts", 16, "Experts in the store, rotated through (16 at Qwen3-30B-"
                     "A3B's width: 150 MB, above the last-level cache).", lower_bound=1)
flags.DEFINE_integer("iters", 50, "Timed calls per round.", lower_bound=1)
flags.DEFINE_integer("rounds", 3, "Rounds (the figure: their medians' median).", lower_bound=1)
flags.DEFINE_string("out", "host_ms.json", "JSON results file (--host_ms=FILE reads it).")


def width() -> tuple[int, int, str]:
  """(hidden, expert intermediate size, where they come from)."""
  if FLAGS.model_dir is None:
    return FLAGS.hidden, FLAGS.inter, "--hidden/--inter"
  if cli.given("hidden") or cli.given("inter"):
    raise cli.UsageError("--model_dir gives the experts' width: drop --hidden/--inter")
  from moejax.model.config import ModelConfig
  cfg = ModelConfig.from_json_file(cli.model_folder(FLAGS.model_dir))
  return cfg.hidden_size, cfg.moe_intermediate_size, FLAGS.model_dir


def main(_):
  d, inter, source = width()
  from moejax.research import host_time
  res = host_time.host_ms(d, inter, FLAGS.experts, FLAGS.iters, FLAGS.rounds)
  res.update(hidden=d, inter=inter, shape_from=source, experts_in_store=FLAGS.experts,
             iters=FLAGS.iters, cpu_count=os.cpu_count())
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"one expert on the host: {res['host_ms']:.3f} ms (D={d}, I={inter}, bf16, "
        f"{'the CPU kernel' if res['cpu_kernel'] else 'XLA'}); wrote {FLAGS.out}: "
        f"moejax-generate --policy=cost --host_ms={FLAGS.out}")


def entry():
  """The console script `moejax-host-ms`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
