"""Eviction rules side by side in the simulator: lru, lfu and least_stale (SpecMD).

  python -m launch.compare_eviction --traces=runs/trace_demo,runs/trace_q30b_synth \
      --cache_fractions=0.125,0.25 --out=runs/eviction.json

For every trace, cache fraction and eviction rule it replays three miss rules (the
first `--prefill_tokens` tokens as a prompt, an empty cache at the start):

  fetch_all          every miss waits (the pure cache: hit rate = 1 - miss rate)
  threshold          threshold(--tau): the first choice and shares >= tau wait
  threshold+adm      the same with background admission(--beta): experts requested
                     asynchronously, inserted for the next token (the simulator's
                     prefetch; speculative prefetch is not simulated)

and prints a markdown table of the hit rate (hits / expert calls) and the waited
(synchronous) fetches per token, summed over MoE layers.  --out also writes JSON.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from moejax.cache import policy as policy_lib
from moejax.io import traces
from moejax.research import simulator

FLAGS = flags.FLAGS
flags.DEFINE_list("traces", None, "Trace folders (launch.trace).", required=True)
flags.DEFINE_list("cache_fractions", ["0.125", "0.25"], "Experts per layer resident.")
flags.DEFINE_list("evictions", list(policy_lib.EVICTIONS), "Eviction rules.")
flags.DEFINE_float("tau", 0.15, "Threshold of the threshold miss rules.")
flags.DEFINE_float("beta", 0.5, "Background admission threshold of threshold+adm.")
flags.DEFINE_integer("max_tokens", 4096, "Replay only the first N tokens (0 = all).")
flags.DEFINE_integer("prefill_tokens", 16, "Leading tokens handled as a prompt.")
flags.DEFINE_string("out", None, "Optional JSON results file.")

RULES = ("fetch_all", "threshold", "threshold+adm")


def policies(eviction: str) -> list[policy_lib.PolicyParams]:
  return [policy_lib.make_policy("fetch_all", eviction=eviction),
          policy_lib.make_policy("threshold", tau=FLAGS.tau, eviction=eviction),
          policy_lib.make_policy("threshold", tau=FLAGS.tau, eviction=eviction,
                                 admission_beta=FLAGS.beta)]


def compare(trace_dir: str) -> list[dict]:
  tr = traces.load_trace(trace_dir, max_tokens=FLAGS.max_tokens)
  rows = []
  for frac in (float(f) for f in FLAGS.cache_fractions):
    pols = [p for ev in FLAGS.evictions for p in policies(ev)]
    res = simulator.simulate(tr.cfg, tr.logits_TxLxR, pols, cache_fraction=frac,
                             prefill_tokens=FLAGS.prefill_tokens, per_step=False)
    for i, ev in enumerate(FLAGS.evictions):
      row = dict(trace=trace_dir, model=f"{tr.cfg.num_experts}e top-{tr.cfg.top_k} "
                 f"x{len(tr.cfg.moe_layers)}", cache_fraction=frac, eviction=ev,
                 slots=res[0].slots, tokens=res[0].tokens)
      for rule, r in zip(RULES, res[3 * i:3 * i + 3]):
        s = r.summary()
        row[rule] = dict(hit_rate=s["hit_rate"], fetches_per_token=s["fetches_per_token"],
                         admitted_per_token=s["admitted_per_token"])
      rows.append(row)
  return rows


def table(rows: list[dict]) -> str:
  head = ("| trace | model | cache | eviction | " +
          " | ".join(f"{r} hit rate | {r} waited fetches/token" for r in RULES) + " |")
  out = [head, "|" + "---|" * (4 + 2 * len(RULES))]
  for row in rows:
    cells = [row["trace"].rstrip("/").split("/")[-1], row["model"],
             f"{row['cache_fraction']:g} ({row['slots']} slots)", row["eviction"]]
    for r in RULES:
      cells += [f"{100 * row[r]['hit_rate']:.2f}%", f"{row[r]['fetches_per_token']:.2f}"]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def main(_):
  for ev in FLAGS.evictions:
    if ev not in policy_lib.EVICTIONS:
      print(f"--evictions: unknown rule {ev!r}; choose from {', '.join(policy_lib.EVICTIONS)}",
            file=sys.stderr)
      return 2
  rows = [row for t in FLAGS.traces for row in compare(t)]
  print(table(rows))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(rows, f, indent=2)
  return 0
