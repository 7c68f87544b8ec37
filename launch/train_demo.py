"""Train the demo MoE (Qwen3-MoE layout) on the CPython standard library and export it.

  python -m launch.train_demo --workdir=runs/demo_train --export_dir=ckpts/demo

Resumable: an orbax CheckpointManager saves every --save_every steps; rerunning the
same command continues from the last checkpoint with the same data order.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from moejax import data
from moejax.config import ModelConfig
from moejax.loader import init_random, save_hf
from moejax.train import TrainConfig, make_optimizer, train_step

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/demo_train", "Checkpoints, tokenizer and token cache.")
flags.DEFINE_string("export_dir", "ckpts/demo", "Where the HF-format model is written.")
flags.DEFINE_integer("steps", 1500, "Total optimizer steps (the cosine schedule spans them).")
flags.DEFINE_integer("batch", 16, "Sequences per step.")
flags.DEFINE_integer("seq", 256, "Tokens per sequence.")
flags.DEFINE_float("lr", 3e-3, "Peak learning rate.")
flags.DEFINE_integer("warmup", 100, "Warm-up steps.")
flags.DEFINE_float("balance_coef", 0.01, "Load-balancing loss coefficient.")
flags.DEFINE_integer("save_every", 50, "Checkpoint interval in steps.")
flags.DEFINE_float("max_hours", 0.0, "Stop (checkpointed, exported) after this long; 0 = no limit.")
flags.DEFINE_integer("vocab", 8192, "BPE vocabulary size.")
flags.DEFINE_integer("hidden", 128, "Hidden size.")
flags.DEFINE_integer("layers", 8, "Decoder layers.")
flags.DEFINE_integer("experts", 64, "Routed experts per layer.")
flags.DEFINE_integer("expert_size", 32, "Expert intermediate size (about hidden/4).")
flags.DEFINE_integer("top_k", 8, "Experts per token.")
flags.DEFINE_bool("export_only", False, "Only export the latest checkpoint.")


def demo_config(vocab: int) -> ModelConfig:
  h = FLAGS.hidden
  return ModelConfig(
      model_type="qwen3_moe", vocab_size=vocab, hidden_size=h, num_layers=FLAGS.layers,
      num_heads=4, num_kv_heads=2, head_dim=h // 4, num_experts=FLAGS.experts,
      top_k=FLAGS.top_k, moe_intermediate_size=FLAGS.expert_size, intermediate_size=4 * h,
      sparse_layers=(True,) * FLAGS.layers, norm_topk_prob=True, rms_norm_eps=1e-6,
      rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
      qk_norm="head", bos_token_id=None, eos_token_ids=(0,)).validate()


def prepare_data(workdir: str):
  """Tokenizer + token streams, cached in workdir (deterministic)."""
  tok_path = os.path.join(workdir, "tokenizer.json")
  train_path = os.path.join(workdir, "train_tokens.npy")
  held_path = os.path.join(workdir, "heldout_tokens.npy")
  man_path = os.path.join(workdir, "dataset.json")
  from tokenizers import Tokenizer
  if all(os.path.exists(p) for p in (tok_path, train_path, held_path, man_path)):
    return Tokenizer.from_file(tok_path), np.load(train_path), json.load(open(man_path))
  logging.info("reading the standard library ...")
  train, held, manifest = data.split_corpus()
  logging.info("training BPE tokenizer (vocab %d) on %d files ...", FLAGS.vocab, len(train))
  tok = data.train_tokenizer(train, FLAGS.vocab)
  tok.save(tok_path)
  tr = data.encode_stream(tok, train)
  he = data.encode_stream(tok, held)
  np.save(train_path, tr)
  np.save(held_path, he)
  manifest.update(train_tokens=int(tr.size), heldout_tokens=int(he.size), vocab_size=FLAGS.vocab)
  json.dump(manifest, open(man_path, "w"), indent=2)
  return tok, tr, manifest


def run_training(cfg, tc: TrainConfig, stream: np.ndarray, ckpt_dir: str, save_every: int,
                 max_hours: float = 0.0, log_path: str | None = None, export_only: bool = False,
                 stop_at: int | None = None):
  """Trains (resuming from the latest checkpoint in ckpt_dir); returns (trainable, step).

  The batch of step s is a pure function of (stream, seed, s), so a run killed and
  restarted from a checkpoint sees the same data order.  `stop_at` ends the run early
  (as a kill would) after checkpointing that step.
  """
  opt, sched = make_optimizer(tc)
  params, experts = init_random(cfg, seed=tc.seed, scale=0.02)
  trainable = (params, [None if e is None else {k: jnp.asarray(v) for k, v in e.items()}
                        for e in experts])
  opt_state = opt.init(trainable)
  order = data.window_order(stream.size, tc.seq, tc.seed)
  mgr = ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                              options=ocp.CheckpointManagerOptions(max_to_keep=2))
  step = 0
  if mgr.latest_step() is not None:
    step = mgr.latest_step()
    state = mgr.restore(step, args=ocp.args.StandardRestore(
        {"trainable": trainable, "opt_state": opt_state}))
    trainable, opt_state = state["trainable"], state["opt_state"]
    logging.info("resumed from step %d", step)
  t0 = time.time()
  end = tc.steps if stop_at is None else min(stop_at, tc.steps)
  if not export_only and step < end:
    bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", mininterval=5)
    while step < end:
      batch = data.window_batch(stream, order, step, tc.batch, tc.seq)
      ts = time.time()
      trainable, opt_state, m = train_step(cfg, tc, opt, trainable, opt_state, jnp.asarray(batch))
      m = {k: float(v) for k, v in m.items()}
      step += 1
      dt = time.time() - ts
      bar.update(1)
      bar.set_postfix(loss=f"{m['ce']:.3f}", bal=f"{m['balance']:.3f}",
                      tok_s=f"{(batch.size - batch.shape[0]) / dt:.0f}")
      if log_path:
        with open(log_path, "a") as f:
          f.write(json.dumps(dict(m, step=step, lr=float(sched(step)), sec=dt,
                                  elapsed=time.time() - t0)) + "\n")
      out_of_time = max_hours and time.time() - t0 > max_hours * 3600
      if step % save_every == 0 or step == end or out_of_time:
        mgr.save(step, args=ocp.args.StandardSave({"trainable": trainable,
                                                   "opt_state": opt_state}))
        mgr.wait_until_finished()
      if out_of_time:
        logging.warning("stopping at step %d: --max_hours reached", step)
        break
    bar.close()
  mgr.wait_until_finished()
  mgr.close()
  return trainable, step


def main(_):
  wd = os.path.abspath(FLAGS.workdir)
  os.makedirs(wd, exist_ok=True)
  tok, stream, manifest = prepare_data(wd)
  cfg = demo_config(tok.get_vocab_size())
  tc = TrainConfig(steps=FLAGS.steps, warmup=FLAGS.warmup, lr=FLAGS.lr, batch=FLAGS.batch,
                   seq=FLAGS.seq, balance_coef=FLAGS.balance_coef)
  logging.info("train tokens %d, config %s", stream.size, cfg)
  trainable, step = run_training(cfg, tc, stream, os.path.join(wd, "ckpt"), FLAGS.save_every,
                                 max_hours=FLAGS.max_hours, log_path=os.path.join(wd, "train_log.jsonl"),
                                 export_only=FLAGS.export_only)
  params, experts = trainable
  os.makedirs(FLAGS.export_dir, exist_ok=True)
  save_hf(cfg, params, experts, FLAGS.export_dir, dtype=jnp.bfloat16,
          tokenizer_json=os.path.join(wd, "tokenizer.json"))
  manifest = dict(manifest, trained_steps=int(step), batch=tc.batch, seq=tc.seq,
                  tokens_seen=int(step) * tc.batch * tc.seq, peak_lr=tc.lr,
                  balance_coef=tc.balance_coef)
  json.dump(manifest, open(os.path.join(FLAGS.export_dir, "training.json"), "w"), indent=2)
  logging.info("exported %s at step %d", FLAGS.export_dir, step)


if __name__ == "__main__":
  app.run(main)
