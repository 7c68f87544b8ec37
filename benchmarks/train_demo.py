"""Train the demo MoE (Qwen3-MoE layout) and export it in Hugging Face format: the logic
(and flags) of `python -m launch.train_demo`.

  python -m launch.train_demo --workdir=runs/demo_train --export_dir=ckpts/demo

The defaults are the shipped model's recipe (ckpts/demo/training.json): the first demo
model (commit cc5f790, no locality loss) taken from this repository's history, 600 steps
of an 800-step schedule with the mutual-information locality loss at 0.2, then a second
stage of 500 steps at 0.5 with expert revival to the end.  A run from scratch:
--init_from='' --stop_at=0 --stage2='' and a schedule of its own.  The corpus is
moejax.train.corpus (--domains); the tokenizer is reused from --tokenizer when given, so
perplexities stay comparable with the model that made it.  Nothing under ckpts/ is
written unless --export_dir names it.

Resumable: an orbax CheckpointManager saves every --save_every steps; rerunning the
same command continues from the last checkpoint with the same data order.  A second
stage (--init_from=<first stage's --workdir>, a new --seed and schedule) starts from the
first stage's latest weights with a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags, logging
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from moejax.train import corpus, data
from moejax.model.config import ModelConfig
from moejax.io.loader import init_random, load_model, save_hf
from benchmarks.trainer import TrainConfig, make_optimizer, revive_experts, train_step

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/demo_train", "Checkpoints, tokenizer and token cache.")
flags.DEFINE_string("export_dir", "runs/demo_export", "Where the HF-format model is written.")
flags.DEFINE_string("data_dir", "", "Token cache (default: --workdir); pilots can share one.")
flags.DEFINE_list("domains", ["python"], "Corpus domains (moejax.train.corpus: python, c, english).")
flags.DEFINE_integer("domain_chars", 12_000_000, "Character cap of each non-python domain.")
flags.DEFINE_string("tokenizer", "ckpts/demo/tokenizer.json",
                    "Reuse this tokenizer.json ('' = train a new BPE on the train split).")
flags.DEFINE_integer("steps", 800, "Total optimizer steps (the cosine schedule spans them).")
flags.DEFINE_integer("batch", 16, "Sequences per step.")
flags.DEFINE_integer("seq", 256, "Tokens per sequence.")
flags.DEFINE_float("lr", 1e-3, "Peak learning rate.")
flags.DEFINE_integer("warmup", 30, "Warm-up steps.")
flags.DEFINE_float("balance_coef", 0.03, "Load-balancing loss coefficient (after the switch).")
flags.DEFINE_float("balance_coef_start", 0.03, "Balance coefficient before --balance_switch_step.")
flags.DEFINE_integer("balance_switch_step", 0, "Step at which --balance_coef takes over.")
flags.DEFINE_enum("balance_scope", "batch", ["batch", "sequence"],
                  "Balance over all tokens of a step, or per sequence.")
flags.DEFINE_float("locality_coef", 0.2, "Weight of the routing-locality loss (--locality_loss).")
flags.DEFINE_float("logit_balance_coef", 0.0,
                   "Weight of the logit-balance loss that revives unused experts.")
flags.DEFINE_enum("locality_loss", "mi", ["cosine", "tv", "mi"],
                  "Locality measure (benchmarks.trainer.aux_losses): mutual information between "
                  "sequence and expert, or adjacent-token consistency (cosine, tv).")
flags.DEFINE_integer("revive_every", 50,
                     "Every N steps, split the most loaded experts into dead ones (0 = off); "
                     "a multiple of --save_every keeps resumed runs identical.")
flags.DEFINE_float("revive_threshold", 0.1, "Dead = share of the window's picks below this / E.")
flags.DEFINE_float("revive_until", 0.9, "No revival after this fraction of --steps.")
flags.DEFINE_integer("stop_at", 600, "End the first stage after this step (checkpointed, as "
                     "a kill would), the schedule still spanning --steps; 0 = at --steps.")
flags.DEFINE_integer("save_every", 50, "Checkpoint interval in steps.")
flags.DEFINE_float("max_hours", 0.0, "Stop (checkpointed, exported) after this long; 0 = no limit.")
flags.DEFINE_integer("vocab", 8192, "BPE vocabulary size.")
flags.DEFINE_integer("hidden", 128, "Hidden size.")
flags.DEFINE_integer("layers", 8, "Decoder layers.")
flags.DEFINE_integer("experts", 64, "Routed experts per layer.")
flags.DEFINE_integer("expert_size", 32, "Expert intermediate size.")
flags.DEFINE_integer("top_k", 8, "Experts per token.")
flags.DEFINE_bool("export_only", False, "Only export the latest checkpoint.")
flags.DEFINE_string("init_from", "git:cc5f790:ckpts/demo",
                    "A second stage: start from the latest checkpoint of this earlier run's "
                    "--workdir, or from an exported model directory (config.json + "
                    "model.safetensors of the same layout; git:<commit>:<folder> takes it from "
                    "this repository's history) -- weights only; a fresh optimizer and "
                    "schedule over --steps.  Ignored once --workdir has a checkpoint of its "
                    "own.")
flags.DEFINE_integer("seed", 6, "Initialisation and data-order seed (use a new one for a stage).")
flags.DEFINE_string("stage2", "locality_coef=0.5,steps=500,warmup=20,seed=7,"
                    "revive_threshold=0.25,revive_until=1.0",
                    "A second stage in the same command: TrainConfig fields to change, e.g. "
                    "'steps=1000,lr=1e-3,seed=1'.  Once --steps are done, training continues "
                    "from the final weights with a fresh optimizer and schedule, in "
                    "<workdir>/stage2 (resumable like the first).  Empty: one stage.")


def stage_overrides(spec: str) -> dict:
  """'k=v,k=v' -> TrainConfig overrides typed like the fields' defaults (--stage2)."""
  defaults = TrainConfig()
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    k, sep, v = item.partition("=")
    if not sep or not hasattr(defaults, k):
      known = ", ".join(f.name for f in dataclasses.fields(TrainConfig))
      raise app.UsageError(f"--stage2: {item!r} is not field=value with a field of "
                           f"TrainConfig ({known})")
    kind = type(getattr(defaults, k))
    try:
      out[k] = kind(v)
    except ValueError:
      raise app.UsageError(f"--stage2: {k}={v!r} is not a {kind.__name__}") from None
  return out


def demo_config(vocab: int) -> ModelConfig:
  h = FLAGS.hidden
  return ModelConfig(
      model_type="qwen3_moe", vocab_size=vocab, hidden_size=h, num_layers=FLAGS.layers,
      num_heads=4, num_kv_heads=2, head_dim=h // 4, num_experts=FLAGS.experts,
      top_k=FLAGS.top_k, moe_intermediate_size=FLAGS.expert_size, intermediate_size=4 * h,
      sparse_layers=(True,) * FLAGS.layers, norm_topk_prob=True, rms_norm_eps=1e-6,
      rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
      qk_norm="head", bos_token_id=None, eos_token_ids=(0,)).validate()


def prepare_data(data_dir: str):
  """Tokenizer + token streams, cached in data_dir (deterministic).

  The train stream is every domain's train documents (each followed by EOT), domain after
  domain; training windows are drawn from all of it, so domains mix within a batch.
  Held-out streams are saved per domain (heldout_<domain>.npy) for evaluation.
  """
  tok_path = os.path.join(data_dir, "tokenizer.json")
  train_path = os.path.join(data_dir, "train_tokens.npy")
  man_path = os.path.join(data_dir, "dataset.json")
  from tokenizers import Tokenizer
  if all(os.path.exists(p) for p in (tok_path, train_path, man_path)):
    manifest = json.load(open(man_path))
    if manifest.get("domain_list") == list(FLAGS.domains):
      return Tokenizer.from_file(tok_path), np.load(train_path), manifest
    raise app.UsageError(f"--data_dir {data_dir} holds domains {manifest.get('domain_list')}, "
                         f"not --domains={','.join(FLAGS.domains)}; use another --data_dir")
  logging.info("assembling the corpus (%s) ...", ",".join(FLAGS.domains))
  parts, manifest = corpus.build(FLAGS.domains, cap_chars=FLAGS.domain_chars)
  if FLAGS.tokenizer:
    tok = Tokenizer.from_file(FLAGS.tokenizer)
  else:
    texts = [t for tr, _ in parts.values() for t in tr]
    logging.info("training BPE tokenizer (vocab %d) on %d documents ...", FLAGS.vocab, len(texts))
    tok = data.train_tokenizer(texts, FLAGS.vocab)
  tok.save(tok_path)
  streams = []
  for dom, (train, held) in parts.items():
    tr = data.encode_stream(tok, train)
    np.save(os.path.join(data_dir, f"heldout_{dom}.npy"), data.encode_stream(tok, held))
    manifest["domains"][dom]["train_tokens"] = int(tr.size)
    streams.append(tr)
  stream = np.concatenate(streams)
  np.save(train_path, stream)
  manifest.update(domain_list=list(FLAGS.domains), train_tokens=int(stream.size),
                  vocab_size=tok.get_vocab_size(), tokenizer=FLAGS.tokenizer or "trained")
  json.dump(manifest, open(man_path, "w"), indent=2)
  return tok, stream, manifest


def _restore(ckpt_dir: str, trainable, opt_state):
  """(trainable, opt_state, step) from the latest checkpoint in ckpt_dir, or None."""
  mgr = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
  step = mgr.latest_step()
  if step is None:
    mgr.close()
    return None
  state = mgr.restore(step, args=ocp.args.StandardRestore(
      {"trainable": trainable, "opt_state": opt_state}))
  mgr.close()
  return state["trainable"], state["opt_state"], step


def _init_weights(cfg, init_from: str, trainable, opt_state):
  """The weights of `init_from`: an exported model directory or a checkpoint directory."""
  if os.path.exists(os.path.join(init_from, "config.json")):
    got_cfg, params, store = load_model(init_from, dtype=jnp.float32)
    if got_cfg != cfg:
      raise app.UsageError(f"--init_from={init_from}: its config.json is not this run's "
                           f"layout ({got_cfg} vs {cfg})")
    experts = [None if e is None else
               {k: jnp.asarray(v) for k, v in store.stacked(i).items() if k in e}
               for i, e in enumerate(trainable[1])]
    logging.info("initialised from the exported model %s", init_from)
    return params, experts
  got = _restore(init_from, trainable, opt_state)
  if got is None:
    raise app.UsageError(f"--init_from={init_from}: no checkpoint there (nor a config.json)")
  logging.info("initialised from %s at its step %d", init_from, got[2])
  return got[0]


def run_training(cfg, tc: TrainConfig, stream: np.ndarray, ckpt_dir: str, save_every: int,
                 max_hours: float = 0.0, log_path: str | None = None, export_only: bool = False,
                 stop_at: int | None = None, init_from: str = ""):
  """Trains (resuming from the latest checkpoint in ckpt_dir); returns (trainable, step).

  The batch of step s is a pure function of (stream, seed, s), so a run killed and
  restarted from a checkpoint sees the same data order.  `stop_at` ends the run early
  (as a kill would) after checkpointing that step.  `init_from` (another run's checkpoint
  directory, or an exported model directory) starts a fresh run from its latest weights,
  with a new optimizer state.
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
    trainable, opt_state, step = _restore(ckpt_dir, trainable, opt_state)
    logging.info("resumed from step %d", step)
  elif init_from:
    trainable = _init_weights(cfg, init_from, trainable, opt_state)
    opt_state = opt.init(trainable)
  t0 = time.time()
  load_sum, load_n = None, 0  # expert loads since the last revival (a window starts at resume)
  end = tc.steps if stop_at is None else min(stop_at, tc.steps)
  if not export_only and step < end:
    bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", mininterval=5)
    while step < end:
      batch = data.window_batch(stream, order, step, tc.batch, tc.seq)
      ts = time.time()
      trainable, opt_state, m = train_step(cfg, tc, opt, trainable, opt_state, jnp.asarray(batch),
                                           jnp.asarray(step, jnp.int32))
      load = np.asarray(m.pop("load"))
      load_sum, load_n = (load if load_sum is None else load_sum + load), load_n + 1
      m = {k: float(v) for k, v in m.items()}
      step += 1
      dt = time.time() - ts
      bar.update(1)
      bar.set_postfix(loss=f"{m['ce']:.3f}", bal=f"{m['balance']:.3f}", loc=f"{m['locality']:.3f}",
                      tok_s=f"{(batch.size - batch.shape[0]) / dt:.0f}")
      if tc.revive_every and step % tc.revive_every == 0:
        share = load_sum / load_n
        m["min_share_x_E"] = float(share.min() * share.shape[-1])
        if step <= tc.revive_until * tc.steps:
          trainable, revived = revive_experts(trainable, share, tc.revive_threshold,
                                              tc.revive_noise, seed=tc.seed * 100_003 + step)
          m["revived"] = revived
          if sum(revived):
            logging.info("step %d: revived %s experts per layer", step, revived)
        load_sum, load_n = None, 0
      if log_path:  # after revival, so its counts are logged with the step
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


def _git_model(spec: str, workdir: str) -> str:
  """`git:<commit>:<folder>`: that commit's model folder (config.json, model.safetensors,
  tokenizer.json) extracted from this repository's history into <workdir>/init."""
  import subprocess   # pylint: disable=g-import-not-at-top
  _, commit, folder = spec.split(":", 2)
  out = os.path.join(workdir, "init")
  os.makedirs(out, exist_ok=True)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    dst = os.path.join(out, name)
    if os.path.exists(dst):
      continue
    got = subprocess.run(["git", "-C", repo, "show", f"{commit}:{folder}/{name}"],
                         capture_output=True)
    if got.returncode:
      raise app.UsageError(f"--init_from={spec}: `git show {commit}:{folder}/{name}` failed "
                           f"({got.stderr.decode().strip()}); a shallow clone lacks the "
                           "history: fetch it (git fetch --unshallow) or pass a model folder")
    with open(dst + ".tmp", "wb") as f:
      f.write(got.stdout)
    os.replace(dst + ".tmp", dst)
  return out


def _init_dir(init_from: str, workdir: str) -> str:
  """--init_from as run_training takes it: a model directory (`git:` ones extracted
  first), or a workdir's ckpt/."""
  if not init_from:
    return ""
  if init_from.startswith("git:"):
    return _git_model(init_from, workdir)
  d = os.path.abspath(init_from)
  return d if os.path.exists(os.path.join(d, "config.json")) else os.path.join(d, "ckpt")


def main(_):
  wd = os.path.abspath(FLAGS.workdir)
  dd = os.path.abspath(FLAGS.data_dir or FLAGS.workdir)
  os.makedirs(wd, exist_ok=True)
  os.makedirs(dd, exist_ok=True)
  tok, stream, manifest = prepare_data(dd)
  cfg = demo_config(tok.get_vocab_size())
  tc = TrainConfig(steps=FLAGS.steps, warmup=FLAGS.warmup, lr=FLAGS.lr, batch=FLAGS.batch,
                   seq=FLAGS.seq, balance_coef=FLAGS.balance_coef,
                   balance_coef_start=FLAGS.balance_coef_start,
                   balance_switch_step=FLAGS.balance_switch_step,
                   balance_scope=FLAGS.balance_scope, locality_coef=FLAGS.locality_coef,
                   locality_loss=FLAGS.locality_loss,
                   logit_balance_coef=FLAGS.logit_balance_coef,
                   revive_every=FLAGS.revive_every, revive_threshold=FLAGS.revive_threshold,
                   revive_until=FLAGS.revive_until, seed=FLAGS.seed)
  logging.info("train tokens %d, config %s", stream.size, cfg)
  trainable, step = run_training(cfg, tc, stream, os.path.join(wd, "ckpt"), FLAGS.save_every,
                                 max_hours=FLAGS.max_hours, log_path=os.path.join(wd, "train_log.jsonl"),
                                 export_only=FLAGS.export_only,
                                 stop_at=FLAGS.stop_at or None,
                                 init_from=_init_dir(FLAGS.init_from, wd))
  stages = [dict(recipe=dataclasses.asdict(tc), steps=int(step))]
  if FLAGS.stage2 and step >= (FLAGS.stop_at or tc.steps):
    tc = dataclasses.replace(tc, **stage_overrides(FLAGS.stage2))
    s2 = os.path.join(wd, "stage2")
    logging.info("stage 2 from step %d: %s", step, FLAGS.stage2)
    trainable, step = run_training(cfg, tc, stream, os.path.join(s2, "ckpt"), FLAGS.save_every,
                                   max_hours=FLAGS.max_hours,
                                   log_path=os.path.join(s2, "train_log.jsonl"),
                                   export_only=FLAGS.export_only,
                                   init_from=os.path.join(wd, "ckpt"))
    stages.append(dict(recipe=dataclasses.asdict(tc), steps=int(step)))
  params, experts = trainable
  os.makedirs(FLAGS.export_dir, exist_ok=True)
  save_hf(cfg, params, experts, FLAGS.export_dir, dtype=jnp.bfloat16,
          tokenizer_json=os.path.join(dd, "tokenizer.json"))
  trained = sum(st["steps"] for st in stages)
  manifest = dict(manifest, trained_steps=trained, batch=tc.batch, seq=tc.seq,
                  tokens_seen=trained * tc.batch * tc.seq, peak_lr=tc.lr,
                  recipe=dataclasses.asdict(tc), stages=stages, argv=" ".join(sys.argv[1:]))
  if FLAGS.init_from:  # a second stage: keep the first stage's record
    manifest["init_from"] = FLAGS.init_from
  json.dump(manifest, open(os.path.join(FLAGS.export_dir, "training.json"), "w"), indent=2)
  logging.info("exported %s at step %d", FLAGS.export_dir, step)
