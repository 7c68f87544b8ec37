"""Record a router trace: per token and MoE layer, the model's router output.

  moejax-trace --model_dir=ckpts/demo --text=held_out --out=runs/trace_demo
  (ckpts/demo: the demo model of a source checkout, relative to the current folder)
  moejax-trace --model_dir=/path/to/Qwen3-30B-A3B --text=my.txt --out=runs/t30b
  moejax-trace --weights=q4_0 ...    # the routing of the model quantized as --weights says

--text: `held_out` (the demo corpus's held-out CPython stdlib files), `humaneval`
(HumanEval prompts + solutions), or a path to a UTF-8 text file.  Documents are
joined with the end-of-text token when the tokenizer has one; their start
offsets go into trace.json.  Recording is teacher-forced over non-overlapping
windows of --seq tokens with every expert resident (any supported family); the
trace format is described in moejax.io.traces and docs/simulator.md in the source
repository.

  moejax-trace --synthesize=qwen3-30b-a3b --fit_trace=runs/trace_demo \
      --out=runs/trace_q30b_synth --max_tokens=4096

synthesises a trace shaped like a named model (moejax.offload.hardware.MODELS: expert
count, top-k, MoE layers) from a recorded trace's routing statistics
(moejax/research/synthetic.py), and records the fit check in trace.json: the recorded
trace's statistics and hit-rate-vs-cache-size curve next to those of a synthetic
trace of the recorded model's own shape.  A SYNTHETIC trace, labelled so.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from moejax.train import data
from moejax.offload import hardware
from moejax.research import simulator, synthetic
from moejax.io import traces
from moejax.io.loader import load_model
from moejax.io.tokenizer import Tokenizer
from moejax.cli import app as cli
from moejax.cli import flagsets

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "ckpts/demo", "HF-format model folder (config.json, "
                    "safetensors, tokenizer.json; the default is relative to the current "
                    "folder: a source checkout's demo model).")
flags.DEFINE_string("text", "held_out", "held_out | humaneval | path to a text file.")
flags.DEFINE_string("out", None, "Output trace folder.", required=True)
flags.DEFINE_integer("max_tokens", 65536, "Tokens to record (0 = all).")
flags.DEFINE_integer("seq", 1024, "Teacher-forcing window (context restarts at each window).")
flags.DEFINE_integer("batch", 1, "Windows per forward pass.")
flags.DEFINE_enum("dtype", "float16", list(traces.DTYPES), "Stored logits dtype.")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Model dtype.")
flags.DEFINE_integer("shard_tokens", 65536, "Tokens per safetensors shard.")
flags.DEFINE_string("synthesize", None, "Synthesise a trace of this model shape instead: "
                    + ", ".join(hardware.MODELS))
flags.DEFINE_string("fit_trace", None, "Recorded trace whose statistics --synthesize fits.")
flags.DEFINE_integer("fit_tokens", 4096, "Tokens of --fit_trace used for the fit.")
flags.DEFINE_integer("seed", 0, "Generator seed (--synthesize).")
flagsets.weights()
FIT_FRACTIONS = (0.125, 0.25, 0.5)


def documents(text: str) -> tuple[list[str], str]:
  if text == "held_out":
    return data.split_corpus()[1], "CPython stdlib held-out split (sha1(path) % 100 < 5)"
  if text == "humaneval":
    return data.humaneval_texts(), "HumanEval prompts + canonical solutions"
  if not os.path.exists(text):
    raise app.UsageError(f"--text={text}: not held_out, humaneval, or an existing file")
  with open(text, encoding="utf-8", errors="replace") as f:
    return [f.read()], f"file {os.path.abspath(text)}"


def lru_curve(cfg, logits) -> list[float]:
  """fetch_all + lru hit rate at FIT_FRACTIONS of the experts resident."""
  return [simulator.simulate(cfg, logits, ["baseline"], cache_fraction=f)[0].summary()[
      "hit_rate"] for f in FIT_FRACTIONS]


def synthesize():
  if not FLAGS.fit_trace:
    raise app.UsageError("--synthesize needs --fit_trace=DIR (a recorded trace)")
  shape = hardware.model_shape(FLAGS.synthesize)
  src = traces.load_trace(FLAGS.fit_trace, max_tokens=FLAGS.fit_tokens)
  measured = synthetic.measure(src.cfg, src.logits_TxLxR)
  gp, fit_stats = synthetic.fit(src.cfg, measured, seed=FLAGS.seed)
  rng = np.random.default_rng(FLAGS.seed)
  # the fit check: a synthetic trace of the recorded model's own shape
  nl_src = len(src.cfg.moe_layers)
  same = synthetic.generate(src.num_tokens, synthetic.popularity_bias(
      measured["popularity_sorted"], src.cfg.num_experts, nl_src, rng), gp, FLAGS.seed + 2)
  check = dict(fractions=FIT_FRACTIONS, recorded_lru_hit_rate=lru_curve(src.cfg,
                                                                          src.logits_TxLxR),
               synthetic_lru_hit_rate=lru_curve(src.cfg, same),
               recorded_share_by_rank=measured["share_by_rank"].mean(0).tolist(),
               synthetic_share_by_rank=synthetic.measure(src.cfg, same)[
                   "share_by_rank"].mean(0).tolist(),
               recorded=dict(first_share=measured["first_share"],
                             reuse1=measured["mean_reuse1"], reuse16=measured["mean_reuse16"]),
               synthetic=fit_stats)
  print(f"[trace] generator fitted to {FLAGS.fit_trace}: {gp}", file=sys.stderr)
  for k in ("recorded_lru_hit_rate", "synthetic_lru_hit_rate", "recorded_share_by_rank",
            "synthetic_share_by_rank"):
    print(f"  {k:<26} " + " ".join(f"{v:.3f}" for v in check[k]), file=sys.stderr)
  cfg = synthetic.shape_config(shape.num_experts, shape.top_k, shape.moe_layers)
  bias = synthetic.popularity_bias(measured["popularity_sorted"], shape.num_experts,
                                   shape.moe_layers, rng)
  n = FLAGS.max_tokens or 4096
  logits = synthetic.generate(n, bias, gp, FLAGS.seed + 3)
  info = dict(synthetic=True, label=f"SYNTHETIC trace shaped like {shape.name}",
              generator=dict(gp.__dict__), fit_trace=os.path.abspath(FLAGS.fit_trace),
              fit_check=check, model_shape=shape.name)
  traces.write_trace(FLAGS.out, synthetic.hf_config(cfg), logits, np.zeros(n, np.int32),
                     dtype=FLAGS.dtype, shard_tokens=FLAGS.shard_tokens, info=info)
  print(f"[trace] wrote SYNTHETIC {FLAGS.out}: {n} tokens, {shape.moe_layers} layers x "
        f"{shape.num_experts} experts top-{shape.top_k}", file=sys.stderr)


def main(_):
  if FLAGS.synthesize:
    return synthesize()
  dtype = jnp.dtype(FLAGS.compute_dtype)
  cfg, params, store = load_model(FLAGS.model_dir, dtype=dtype, weights=FLAGS.weights)
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
              compute_dtype=FLAGS.compute_dtype, weights=FLAGS.weights, recording="teacher-forced, all experts "
              "resident, windows of --seq tokens")
  traces.write_trace(FLAGS.out, model_config, logits, np.asarray(ids, np.int32),
                     dtype=FLAGS.dtype, shard_tokens=FLAGS.shard_tokens, windows=windows,
                     documents=[s for s in starts if s < len(ids)], info=info)
  print(f"[trace] wrote {FLAGS.out}: {len(ids)} tokens, {len(windows)} windows", file=sys.stderr)


def entry():
  """The console script `moejax-trace`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
