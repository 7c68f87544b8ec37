"""moejax-generate's policy flags: the policy --policy and its knobs name, --policy=auto's
tuning, and the cost rule's times (--profile's link, --host_ms's measured host expert).

The flags are moejax-generate's (moejax.cli.generate defines them on absl's FLAGS); the
functions read them and raise `app.UsageError` naming the flag.
"""

from __future__ import annotations

import sys

from absl import flags

from moejax.cli import app as cli

FLAGS = flags.FLAGS


def check_auto_flags():
  """--policy=auto: a budget, and no knob that auto-tuning chooses."""
  from moejax.research import autotune
  if FLAGS.random_model:
    raise cli.UsageError("--policy=auto tunes on moejax's calibration text: it needs a model "
                         "with its tokenizer, not --random_model")
  for n in ("tau", "admission_beta", "eviction"):
    if cli.given(n):
      raise cli.UsageError(f"--{n} is chosen by --policy=auto; drop it, or name a policy")
  if FLAGS.profile is not None:   # NAMExN: N expert-parallel GPUs, as --expert_devices=N
    try:
      hw = autotune.hardware.hardware(FLAGS.profile)
    except autotune.hardware.ProfileError as e:
      raise cli.UsageError(str(e).replace("--profiles:", "--profile:", 1)) from None
    n = FLAGS.expert_devices
    if hw.devices != n:
      base = FLAGS.profile.rpartition("x")[0] if hw.devices > 1 else FLAGS.profile
      raise cli.UsageError(f"--profile={FLAGS.profile} times {hw.devices} device(s) but the "
                           f"engine runs on --expert_devices={n}: use --profile="
                           f"{base + f'x{n}' if n > 1 else base}")
  try:
    return autotune.Budget(FLAGS.ppl_budget, FLAGS.tpot_budget_ms, FLAGS.profile)
  except autotune.AutoTuneError as e:
    raise cli.UsageError(str(e)) from None


def resolve_auto(cfg, params, store, tok, cache_fraction: float):
  """--policy=auto: the policy tuned on the calibration text that ships with moejax
  (printing what it chose and why, and the measured points), before the engine is built.  cache_fraction:
  the union's (expert-parallel: N devices' slots are one cache)."""
  import tempfile
  from moejax.research import autotune, frontier
  budget = check_auto_flags()
  print(f"[moejax] --policy=auto: tuning for {budget.describe()} on moejax's calibration "
        "text (a simulator sweep, then emulator checks; minutes on a CPU)...", file=sys.stderr)
  log = lambda line: print(line, file=sys.stderr, flush=True)
  try:
    with tempfile.TemporaryDirectory() as d:
      policy, res = frontier.auto_policy(cfg, params, store, tok, budget, d,
                                         cache_fraction=cache_fraction, log=log)
  except autotune.AutoTuneError as e:
    raise cli.UsageError(str(e)) from None
  a = res["auto"][0]
  print(f"[moejax] auto chose {policy.describe()}: {a['reason']}; perplexity "
        f"{a['calibration_pct']:+.2f}% measured (fit predicted {a['predicted_pct']:+.2f}%), "
        f"{a['projected_speedup_rtx3090']:.2f}x fetch_all's projected speed on rtx3090",
        file=sys.stderr)
  print("[moejax] measured frontier (dPPL %, projected speed-up on rtx3090): " + ", ".join(
      f"{q['policy']} {q['ppl_increase_pct']:+.2f}% {q['projected_speedup_rtx3090']:.2f}x"
      for q in sorted(res["points"], key=lambda q: q["ppl_increase_pct"]) if q["pareto"]),
      file=sys.stderr)
  return policy


def named_policy():
  """The policy --policy (not auto) and its knobs name."""
  from moejax.cache.policy import make_policy as make
  return make(FLAGS.policy, tau=FLAGS.tau, admission_beta=FLAGS.admission_beta,
              eviction=FLAGS.eviction, lam=FLAGS.lam, tau_low=FLAGS.tau_low,
              low_bits=None if FLAGS.low_bits is None else int(FLAGS.low_bits))


def cost_policy(policy, store):
  """--policy=cost with --profile: the cost model's times from that profile's link and
  this model's experts; the low-precision store a low-fetching policy reads, from the
  disk cache -> (policy, low store or None)."""
  import dataclasses
  from moejax.cache import cost
  from moejax.io import quant
  from moejax.offload import hardware
  d = policy.decision
  if d.miss == "cost" and FLAGS.profile is not None and FLAGS.policy != "auto":
    # (--policy=auto keeps the cost model its lambda was tuned with)
    hw = hardware.hardware(FLAGS.profile)
    shapes = {k: tuple(v.shape) for k, v in store.get(store.moe_layers[0], 0).items()}
    model = cost.from_profile(quant.bf16_nbytes(shapes), quant.low_nbytes(shapes, d.low_bits),
                              hw.link_Bps, hw.link_latency_s, cost.DEMO_SLOPES, d.low_bits)
    policy = dataclasses.replace(policy, decision=dataclasses.replace(d, cost=model))
  if d.miss == "cost" and FLAGS.host_ms is not None and FLAGS.policy != "auto":
    try:                          # the host option's time: measured (moejax-host-ms)
      host_ms = cost.measured_host_ms(FLAGS.host_ms)
    except ValueError as e:
      raise cli.UsageError(f"--host_ms: {e}") from None
    d = policy.decision
    policy = dataclasses.replace(policy, decision=dataclasses.replace(
        d, cost=cost.with_host(d.cost_model(), host_ms)))
  low = (quant.load_or_build(store, d.low_bits, model_dir=FLAGS.model_dir)
         if d.low and FLAGS.model_dir else None)
  return policy, low
