"""Record a router trace: per token and MoE layer, the model's router output.

  python -m launch.trace --model_dir=ckpts/demo --text=held_out --out=runs/trace_demo
  python -m launch.trace --model_dir=/path/to/Qwen3-30B-A3B --text=my.txt --out=runs/t30b

--text: `held_out` (the demo corpus's held-out CPython stdlib files), `humaneval`
(HumanEval prompts + solutions), or a path to a UTF-8 text file.  Documents are
joined with the end-of-text token when the tokenizer has one; their start
offsets go into trace.json.  Recording is teacher-forced over non-overlapping
windows of --seq tokens with every expert resident (any supported family); the
trace format is described in moejax/traces.py and docs/simulator.md.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from moejax import data, traces
from moejax.loader import load_model
from moejax.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder (config.json, "
                    "safetensors, tokenizer.json).")
flags.DEFINE_string("text", "held_out", "held_out | humaneval | path to a text file.")
flags.DEFINE_string("out", None, "Output trace folder.", required=True)
flags.DEFINE_integer("max_tokens", 65536, "Tokens to record (0 = all).")
flags.DEFINE_integer("seq", 1024, "Teacher-forcing window (context restarts at each window).")
flags.DEFINE_integer("batch", 1, "Windows per forward pass.")
flags.DEFINE_enum("dtype", "float16", list(traces.DTYPES), "Stored logits dtype.")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Model dtype.")
flags.DEFINE_integer("shard_tokens", 65536, "Tokens per safetensors shard.")


def documents(text: str) -> tuple[list[str], str]:
  if text == "held_out":
    return data.split_corpus()[1], "CPython stdlib held-out split (sha1(path) % 100 < 5)"
  if text == "humaneval":
    return data.humaneval_texts(), "HumanEval prompts + canonical solutions"
  if not os.path.exists(text):
    raise app.UsageError(f"--text={text}: not held_out, humaneval, or an existing file")
  with open(text, encoding="utf-8", errors="replace") as f:
    return [f.read()], f"file {os.path.abspath(text)}"


def main(_):
  dtype = jnp.dtype(FLAGS.compute_dtype)
  cfg, params, store = load_model(FLAGS.model_dir, dtype=dtype)
  tok = Tokenizer(FLAGS.model_dir)
  docs, corpus = documents(FLAGS.text)
  eot = tok.token_id(data.EOT)
  ids, starts = [], []
  for d in docs:
    starts.append(len(ids))
    ids.extend(tok.encode(d))
    if eot is not None:
      ids.append(eot)
    if FLAGS.max_tokens and len(ids) >= FLAGS.max_tokens:
      break
  ids = ids[:FLAGS.max_tokens] if FLAGS.max_tokens else ids
  print(f"[trace] {len(ids)} tokens of {corpus} ({len(starts)} documents), "
        f"{cfg.model_type} {len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts",
        file=sys.stderr)
  logits, windows = traces.record_router_logits(cfg, params, store, ids, seq=FLAGS.seq,
                                                batch=FLAGS.batch, dtype=dtype, progress=True)
  with open(os.path.join(FLAGS.model_dir, "config.json")) as f:
    model_config = json.load(f)
  info = dict(model_dir=os.path.abspath(FLAGS.model_dir), corpus=corpus, text=FLAGS.text,
              tokenizer=os.path.join(os.path.abspath(FLAGS.model_dir), "tokenizer.json"),
              tokenizer_sha256=traces.file_sha256(os.path.join(FLAGS.model_dir,
                                                               "tokenizer.json")),
              compute_dtype=FLAGS.compute_dtype, recording="teacher-forced, all experts "
              "resident, windows of --seq tokens")
  traces.write_trace(FLAGS.out, model_config, logits, np.asarray(ids, np.int32),
                     dtype=FLAGS.dtype, shard_tokens=FLAGS.shard_tokens, windows=windows,
                     documents=[s for s in starts if s < len(ids)], info=info)
  print(f"[trace] wrote {FLAGS.out}: {len(ids)} tokens, {len(windows)} windows", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
