"""Flags that several moejax programs share, each defined once here with one help text
(`model_dir`, `dtype`, `engine`: a program calls the groups it offers at import; its own
flags stay in its module), and the checks of moejax-generate's policy flags (--policy and
the knobs it names, --policy=auto's tuning, the cost rule's times: --profile's link,
--host_ms's measured host expert), which raise `app.UsageError` naming the flag.

A shared flag already defined in the process (two programs imported by one test) is left as
the first definition made it.
"""

from __future__ import annotations

import sys

from absl import flags

from moejax.cli import app as cli

FLAGS = flags.FLAGS
flags.disclaim_key_flags()   # a flag defined here is a key flag of the program that asks for it

DEMO = "./ckpts/demo"


def _define(kind, name: str, default, help_text: str, enum_values=None, **bounds) -> None:
  if name in FLAGS:              # defined by another program in this process: claim it too
    flags.declare_key_flag(name)
    return
  if enum_values is not None:
    flags.DEFINE_enum(name, default, enum_values, help_text)
  else:
    getattr(flags, f"DEFINE_{kind}")(name, default, help_text, **bounds)


def model_dir(default: str | None = None, what: str = "Hugging Face model folder "
              "(config.json, model.safetensors or its sharded index, tokenizer.json)",
              where: str | None = None) -> None:
  """--model_dir: the model folder (None: the demo model, resolved by `app.model_folder`,
  unless `where` says what unset means)."""
  where = where or default or (f"the demo model, {DEMO} under the current folder (a source "
                                "checkout has it; a pip-installed copy does not)")
  _define("string", "model_dir", default, f"{what}. Default: {where}.")


def tokens_file() -> None:
  """--tokens_file: the encoded training stream (the prefetch predictors' programs)."""
  _define("string", "tokens_file", "", "The encoded training stream as .npy (same tokenizer; "
          "the demo model's training writes <data_dir>/train_tokens.npy; the held-out stream "
          "is heldout_python.npy beside it when there); default: encode the corpus' train "
          "split (slow).")


def dtype() -> None:
  """--dtype: the compute/parameter dtype."""
  _define("enum", "dtype", "float32", "Compute/parameter dtype.",
          enum_values=["float32", "bfloat16"])


def weights(auto: bool = False) -> None:
  """--weights: the weights' format (ggml's block formats: moejax.io.weights.quantized);
  auto: offer --weights=auto (moejax-generate: chosen by --policy=auto under --cache_bytes)."""
  more = (" auto: with --policy=auto and --cache_bytes, the format (and its cache and "
          "policy) that --policy=auto picks under that memory budget "
          "(moejax/research/formats.py)." if auto else "")
  _define("enum", "weights", "float", "Weight format: float (the checkpoint's floats in "
          "--dtype) or one of ggml's block formats q8_0, q4_0, q4_k, q6_k: the routed "
          "experts and every dense linear (attention, shared experts, LM head, embeddings, "
          "as llama-quantize does; norms and routers keep their precision), quantized once "
          "into $MOEJAX_CACHE_DIR (default ~/.cache/moejax) and mapped by later runs. A "
          "--model_dir=FILE.gguf runs in the file's own formats (leave this at float)." + more,
          enum_values=["float", "q8_0", "q4_0", "q4_k", "q6_k"] + (["auto"] if auto else []))


def link() -> None:
  """--link: the host->device link."""
  _define("string", "link", None, "Host->device link: 'native' (the real copy), "
          "'scaled[:PROFILE]' (emulated, scaled to a GPU) or e.g. '16GB/s,10us'. Default: "
          "native on an accelerator, scaled on a CPU-only machine.")


def engine() -> None:
  """The offload engine's launch settings: the expert budget (--cache_fraction or
  --cache_bytes), where the experts wait (--store, --host_cache_gb), the link, and the
  default policy's
  knobs (--tau, --admission_beta, --eviction)."""
  _define("float", "cache_fraction", None, "With a policy: share of each layer's experts "
          "resident (default 0.25).")
  _define("integer", "cache_bytes", None, "With a policy: device memory for the expert cache "
          "in bytes, over all MoE layers (instead of --cache_fraction).")
  _define("enum", "store", None, "Where the experts wait on the host: numpy (RAM, "
          "default), mmap (the checkpoint file on disk, read through the page cache: a model "
          "larger than RAM; a per-expert checkpoint is repacked once into "
          "$MOEJAX_CACHE_DIR, default ~/.cache/moejax), pinned_host (page-locked memory: the "
          "fast DMA path on a GPU). Without a policy on the CPU, mmap keeps every expert in "
          "the mapped file (as llama.cpp's mmap).", enum_values=["numpy", "mmap", "pinned_host"])
  _define("float", "host_cache_gb", None, "With a policy and --store=mmap: a host staging "
          "tier of this many GB between the mapped file and the device (a model larger than "
          "RAM on an accelerator; the engine documentation, docs/engine.md in the source "
          "repository). Default: off.")
  link()
  _define("float", "tau", None, "With --policy=threshold or quality: normalised gate share "
          "at or above which a miss waits (default 0.15).")
  _define("float", "admission_beta", None, "With a policy: background admission threshold "
          "(> 0).")
  _define("enum", "eviction", None, "With a policy: eviction rule (default: the preset's; "
          "least_stale: SpecMD's Least-Stale, see moejax.cache.policy).",
          enum_values=["lru", "lfu", "least_stale"])


def policy_knobs() -> None:
  """The knobs of a named policy's miss rules, of --policy=auto and of expert parallelism:
  the flags the checks below read (--lam, --host_ms, --tau_low, --low_bits, --ppl_budget,
  --tpot_budget_ms, --profile, --expert_devices)."""
  _define("float", "lam", None, "With --policy=cost: milliseconds a token is worth one "
          "percentage point of perplexity (0 never waits). Default 1. Times come from "
          "--profile's link and this model's expert bytes (default: a Qwen3-30B-A3B expert "
          "over the RTX 3090 profile's PCIe link), quality from the demo model's calibration "
          "(moejax/cache/cost.py).")
  _define("string", "host_ms", None, "With --policy=cost: offer the host option, one expert "
          "computed on the host CPU in this many ms, measured: a number, or the JSON of "
          "moejax-host-ms (its host_ms). Without it no host option.")
  _define("float", "tau_low", None, "With --policy=threshold_low: share at or above which a "
          "miss below --tau fetches its low-precision copy (default 0.02).")
  _define("enum", "low_bits", None, "With --policy=fetch_low, threshold_low or cost: the "
          "low-precision copies, int8 per row or int4 per group of 32 (default 8); made once "
          "and cached in ~/.cache/moejax/quant/<checkpoint hash>/.", enum_values=["8", "4"])
  _define("float", "ppl_budget", None, "With --policy=auto: the largest perplexity increase "
          "over fetch_all, in percent (e.g. 1.0).")
  _define("float", "tpot_budget_ms", None, "With --policy=auto and --profile: the longest "
          "projected time per token (ms) of this model on that hardware profile.")
  _define("string", "profile", None, "Hardware profile (moejax/offload/hardware.py) of the "
          "cost model and of auto-tuning: rtx3090, rtx4090, a100, h100, h200, gh200.")
  _define("integer", "expert_devices", 1, "With --policy: spread each MoE layer's expert "
          "slots over N devices (expert parallelism; the cache budget is per device). On a "
          "CPU-only machine the N host devices are provided here.", lower_bound=1)


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
  """The policy --policy (not auto) and its knobs name; an unknown name is a usage error
  listing every choice of --policy, auto included."""
  from moejax.cache.policy import MISS_RULES, PRESETS, make_policy as make
  if FLAGS.policy not in PRESETS and FLAGS.policy not in MISS_RULES:
    raise cli.UsageError(f"--policy: unknown policy or preset {FLAGS.policy!r}; choose one "
                         f"of {', '.join(tuple(PRESETS) + MISS_RULES + ('auto',))}")
  return make(FLAGS.policy, tau=FLAGS.tau, admission_beta=FLAGS.admission_beta,
              eviction=FLAGS.eviction, lam=FLAGS.lam, tau_low=FLAGS.tau_low,
              low_bits=None if FLAGS.low_bits is None else int(FLAGS.low_bits))


def resolve_auto_weights(folder: str, tok, dtype):
  """--policy=auto --weights=auto: the weight format, its expert cache under --cache_bytes
  and its policy, weighed on moejax's calibration text (`formats.table`: the emulator's
  perplexity against the float model, the simulator's projected time in each format's
  bytes), printing the table and the choice; sets --weights to the chosen format and
  returns the chosen policy."""
  import tempfile
  from moejax.cache.policy import make_policy
  from moejax.io.loader import load_model
  from moejax.research import autotune, formats
  budget = check_auto_flags()
  print(f"[moejax] --policy=auto --weights=auto: weighing the weight formats under "
        f"--cache_bytes={FLAGS.cache_bytes} for {budget.describe()} on moejax's calibration "
        "text (emulator runs per format; minutes on a CPU)...", file=sys.stderr)
  log = lambda line: print(line, file=sys.stderr, flush=True)
  try:
    with tempfile.TemporaryDirectory() as d:
      res = formats.table(lambda w: load_model(folder, dtype=dtype, weights=w), tok,
                          FLAGS.cache_bytes, budget, d, dtype=dtype, log=log)
  except autotune.AutoTuneError as e:
    raise cli.UsageError(str(e)) from None
  print(formats.format_table(res), file=sys.stderr)
  print(f"[moejax] auto chose {res['choice']['reason']}", file=sys.stderr)
  FLAGS.weights = res["choice"]["weights"]
  return make_policy(res["choice"]["policy"])


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
