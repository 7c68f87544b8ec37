"""Generate text with a MoE model from a local Hugging Face folder.

  moejax-generate --prompt="def fib(n):"   # the demo model: ./ckpts/demo under the current
                                           # folder (a source checkout has it)
  moejax-generate --model_dir=/path/to/Qwen3-30B-A3B --dtype=bfloat16 \\
      --policy=quality --cache_fraction=0.25 --store=mmap

The text streams to stdout as it is generated when stdout is a terminal (--stream).

Without --policy every expert is resident on the device.  With --policy the
offload engine keeps a budget of experts per layer on the device (--cache_fraction
or --cache_bytes) and fetches the rest from the expert store (--store) over the
link (--link).  Before loading, it prints the host RAM and device memory the
choice needs (--dry_run stops there).

Exit codes: 0 success; 2 usage error (one line naming the flag); 1 runtime
failure, e.g. a corrupt checkpoint (one line naming the file and tensor; the
traceback with --verbose).
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from moejax.cli import app as cli
from moejax.cli import flagsets

FLAGS = flags.FLAGS
OFFLOAD_FLAGS = ("cache_fraction", "cache_bytes", "link", "tau", "admission_beta",
                 "lam", "tau_low", "low_bits",
                 "eviction", "prefetch", "speculative", "estimators", "streaming",
                 "ppl_budget", "tpot_budget_ms", "expert_devices", "host_cache_gb")

flagsets.model_dir()
flagsets.dtype()
flagsets.engine()
flagsets.weights(auto=True)
flagsets.policy_knobs()
flags.DEFINE_bool("random_model", False, "Use a small random-weight Qwen3-MoE built on the "
                  "spot (its output is noise; for trying the flags) instead of --model_dir.")
flags.DEFINE_string("prompt", "def fibonacci(n):", "Prompt text.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples.", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1] (with --temperature > 0).")
flags.DEFINE_integer("seed", 0, "Sampling seed (with --temperature > 0).")
flags.DEFINE_integer("max_len", None, "Longest sequence (prompt + new tokens). Default: the "
                     "model's own limit (max_position_embeddings); larger values warn. The KV "
                     "cache is sized to what the prompt and --max_new_tokens need.")
flags.DEFINE_bool("stream", None, "Write the text to stdout token by token as it is generated. "
                  "Default: on when stdout is a terminal. With --policy and a native link, "
                  "streaming decodes token by token instead of in one on-device loop.")
flags.DEFINE_bool("progress", None, "A progress bar on stderr while the weights load. Default: "
                  "on when stderr is a terminal.")
flags.DEFINE_bool("dry_run", False, "Print the model and the memory it needs, then exit.")
flags.DEFINE_string("policy", None, "Offload policy: a preset (quality, speed, baseline) or a "
                    "miss rule (fetch_all, threshold, first_choice, substitute_all, host), or "
                    "auto (tuned to --ppl_budget or --tpot_budget_ms on the calibration text "
                    "that ships with moejax, before generating; moejax.research.autotune). "
                    "Unset: every expert resident, no offloading.")
flags.DEFINE_enum("prefetch", None, ["none", "reuse", "quasi", "previous", "hybrid"],
                  "With --policy: speculative prefetch of the next layer's predicted experts "
                  "(previous: the experts that layer chose at the previous token; quasi, "
                  "hybrid: the files of moejax-default-vectors / moejax-train-estimators, "
                  "loaded from <model_dir>-estimators or --estimators).")
flags.DEFINE_enum("speculative", None, ["off", "predicted_weights", "true_router"],
                  "With --prefetch: run each layer on its predicted experts without refetching "
                  "a wrong prediction (predicted or true router weights).")
flags.DEFINE_string("estimators", None, "With --prefetch=quasi/hybrid: the folder holding "
                    "default_vectors/ and the estimators (default: <model_dir>-estimators).")
flags.DEFINE_bool("streaming", None, "With --policy: no expert cache; each layer's experts are "
                  "streamed in and none is kept across tokens.")


def check_flags():
  """Flag combinations that cannot work or would be silently ignored: UsageError."""
  if FLAGS.random_model and cli.given("model_dir"):
    raise cli.UsageError("--random_model builds a random-weight model; drop --model_dir or "
                         "--random_model")
  if FLAGS.policy is None:
    stray = [f"--{n}" for n in OFFLOAD_FLAGS if cli.given(n)]
    if stray:
      verb = "applies" if len(stray) == 1 else "apply"
      raise cli.UsageError(f"{', '.join(stray)} {verb} only with --policy (without --policy "
                           "every expert is resident); add e.g. --policy=quality")
  if cli.given("cache_fraction") and cli.given("cache_bytes"):
    raise cli.UsageError("--cache_fraction and --cache_bytes both set the expert budget; "
                         "give one")
  if cli.given("speculative") and FLAGS.speculative != "off" and FLAGS.prefetch in (None, "none"):
    raise cli.UsageError("--speculative executes the predicted experts: it needs "
                         "--prefetch=reuse, quasi, previous or hybrid")
  if FLAGS.streaming and (cli.given("cache_fraction") or cli.given("cache_bytes")):
    raise cli.UsageError("--streaming keeps no expert cache: drop --cache_fraction/--cache_bytes")
  if FLAGS.expert_devices > 1 and FLAGS.prefetch not in (None, "none"):
    raise cli.UsageError("--expert_devices > 1 with --prefetch: speculative prefetch is not "
                         "expert-parallel yet; drop one of them")
  if FLAGS.max_len is not None and FLAGS.max_len < 2:
    raise cli.UsageError(f"--max_len must be >= 2, got {FLAGS.max_len}")
  if not 0.0 < FLAGS.top_p <= 1.0:
    raise cli.UsageError(f"--top_p must be in (0, 1], got {FLAGS.top_p}")
  if FLAGS.temperature == 0 and (cli.given("top_p") or cli.given("seed")):
    raise cli.UsageError("--top_p and --seed apply to sampling; with --temperature=0 "
                         "(greedy, the default) they change nothing: give --temperature > 0")
  if FLAGS.weights == "auto" and (FLAGS.policy != "auto" or not FLAGS.cache_bytes):
    raise cli.UsageError("--weights=auto weighs the formats under a memory budget with "
                         "--policy=auto: give --policy=auto and --cache_bytes")
  if FLAGS.policy == "auto":
    flagsets.check_auto_flags()
  elif FLAGS.policy is not None:
    policy = flagsets.named_policy()
    for flag, rules in (("lam", ("cost",)), ("tau_low", ("threshold_low",)),
                        ("low_bits", ("fetch_low", "threshold_low", "cost"))):
      if cli.given(flag) and policy.miss not in rules:
        raise cli.UsageError(f"--{flag} applies to --policy={' or '.join(rules)}; "
                             f"--policy={FLAGS.policy} ignores it")
    if cli.given("tau") and policy.miss not in ("threshold", "threshold_low"):
      raise cli.UsageError(f"--tau applies to the threshold rule (--policy=threshold or "
                           f"quality); --policy={FLAGS.policy} ({policy.describe()}) ignores it")
    if cli.given("admission_beta") and policy.miss == "fetch_all":
      raise cli.UsageError(f"--admission_beta has no effect with --policy={FLAGS.policy}: it "
                           "waits for every miss, so no miss accumulates gate mass")


def cache_fraction() -> float:
  return 0.25 if FLAGS.cache_fraction is None else FLAGS.cache_fraction


def link_spec() -> str:
  """--link, or its default: native on an accelerator, scaled on a CPU-only machine."""
  import jax
  if FLAGS.link is not None:
    return FLAGS.link
  from moejax.offload.link import default_spec
  return default_spec(jax.devices()[0].platform)


def model_folder() -> str:
  """--model_dir, checked to be a model folder (usage error otherwise)."""
  return cli.model_folder(FLAGS.model_dir)


def random_demo_config():
  from moejax.model.config import ModelConfig
  return ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, num_experts=16, top_k=4,
                     moe_intermediate_size=16, intermediate_size=128,
                     sparse_layers=(True,) * 4, qk_norm="head",
                     max_position_embeddings=2048).validate()


def sequence_length(cfg, prompt_len: int) -> int:
  """The KV cache length: what the prompt and --max_new_tokens need, checked against
  --max_len (default: the model's limit), rounded up to a multiple of 64 within it."""
  from moejax.model.sampler import bucket
  limit = cfg.max_position_embeddings
  max_len = FLAGS.max_len if FLAGS.max_len is not None else limit
  if FLAGS.max_len is not None and FLAGS.max_len > limit:
    print(f"[moejax] warning: --max_len={FLAGS.max_len} is beyond the model's limit of "
          f"{limit} positions (max_position_embeddings): it was never trained on them",
          file=sys.stderr)
  need = prompt_len + FLAGS.max_new_tokens
  if need > max_len:
    src = "--max_len" if FLAGS.max_len is not None else "the model's limit"
    if prompt_len >= max_len:
      raise cli.UsageError(f"--prompt is {prompt_len} tokens, longer than the context of "
                           f"{max_len} ({src}); shorten --prompt or raise --max_len")
    raise cli.UsageError(f"--prompt ({prompt_len} tokens) + --max_new_tokens "
                         f"({FLAGS.max_new_tokens}) exceed the context of {max_len} ({src}); "
                         f"lower --max_new_tokens to {max_len - prompt_len} or raise --max_len")
  return min(max_len, max(need, bucket(need, minimum=64)))


def main(_):
  check_flags()
  folder = None if FLAGS.random_model else model_folder()
  from moejax.offload import expert_parallel
  expert_parallel.provide_cpu_devices(FLAGS.expert_devices)   # before JAX starts
  import jax
  import jax.numpy as jnp
  from moejax.offload import memory
  from moejax.model.config import ModelConfig
  from moejax.io.tokenizer import ByteTokenizer, Tokenizer
  from moejax.io.weights import gguf_align
  dtype = jnp.dtype(FLAGS.dtype)
  store_kind = FLAGS.store or "numpy"
  gguf, nbytes = folder is not None and folder.endswith(".gguf"), None
  if gguf and FLAGS.weights != "float":
    raise cli.UsageError(f"--weights={FLAGS.weights}: a GGUF file runs in its own formats; "
                         f"leave --weights at float")
  if FLAGS.random_model:
    cfg, tok = random_demo_config(), ByteTokenizer()
    desc = "RANDOM-WEIGHT model (--random_model: its output is noise)"
  else:
    cfg, tok_path, nbytes = model_files(folder)
    if not os.path.exists(tok_path):
      raise cli.UsageError(f"--model_dir={folder!r} has no tokenizer.json (moejax reads the "
                           "Hugging Face tokenizers format)")
    tok, desc = Tokenizer(tok_path), folder
  ids = tok.encode(FLAGS.prompt)
  if not ids:
    raise cli.UsageError("--prompt encodes to no tokens")
  seq = sequence_length(cfg, len(ids))
  if store_kind == "pinned_host":
    from moejax.io.store import memory_kinds
    if "pinned_host" not in memory_kinds():
      raise cli.UsageError(f"--store=pinned_host: {jax.devices()[0]} offers no pinned_host "
                           f"memory (it offers {', '.join(memory_kinds())}); use numpy or mmap")
  chosen = (flagsets.resolve_auto_weights(folder, tok, dtype) if FLAGS.weights == "auto"
            else None)            # --weights is the chosen format from here on
  mxfp4 = folder is not None and not gguf and memory.checkpoint_is_mxfp4(folder)
  plan = memory.plan_memory(cfg, dtype, store=store_kind, offload=FLAGS.policy is not None,
                            cache_fraction=cache_fraction(), cache_bytes=FLAGS.cache_bytes,
                            kv_len=seq, mxfp4=mxfp4, host_cache_gb=FLAGS.host_cache_gb,
                            weights=FLAGS.weights, nbytes=nbytes,
                            store_copied=gguf and gguf_align.copied_whole(folder, store_kind,
                                                                          FLAGS.policy))
  if FLAGS.policy is not None:   # a bad --link or missing --prefetch files: before loading
    from moejax.offload.link import parse_link
    parse_link(link_spec(), expert_bytes=plan.expert_bytes, layer_compute_s=1e-3)
    preds = predictors(cfg, folder)
  announce(cfg, desc, plan, None if gguf else folder, dtype, store_kind)
  if FLAGS.dry_run:
    return 0
  cfg, params, store = load(cfg, folder, dtype, store_kind)
  from moejax.model.sampler import SamplingParams
  sp = SamplingParams(FLAGS.temperature, FLAGS.top_p, FLAGS.max_new_tokens,
                      tuple(cfg.eos_token_ids))
  if FLAGS.policy is not None:
    union = min(1.0, cache_fraction() * FLAGS.expert_devices)   # the devices' one cache
    policy = (chosen if chosen is not None else
              flagsets.resolve_auto(cfg, params, store, tok, union)
              if FLAGS.policy == "auto" else flagsets.named_policy())
    held = [params]     # handed over: the engine keeps its own (stacked) copy of the layers
    del params
    return generate_offloaded(cfg, held, store, tok, ids, sp, dtype, seq, policy, preds)
  return generate_resident(cfg, params, store, tok, ids, sp, dtype, seq)


def announce(cfg, desc: str, plan, folder: str | None, dtype, store_kind: str):
  """The model and its memory plan on stderr, with a note where loading converts the
  checkpoint's dtype; a repack (--store other than numpy) that its disk cannot hold is a
  UsageError before anything loads.  folder: a safetensors folder (None: a GGUF file or
  the random model)."""
  import jax
  import jax.numpy as jnp
  from moejax.io import loader, repack
  platform = jax.devices()[0].platform
  print(f"[moejax] {desc}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_experts} "
        f"experts top-{cfg.top_k}, {FLAGS.dtype}, on {platform}; memory needed (MB = 10^6 bytes, "
        f"GB = 10^9):", file=sys.stderr)
  for line in plan.lines():
    print(f"  {line}", file=sys.stderr)
  stored = loader.checkpoint_dtype(folder)
  if stored and stored != jnp.dtype(dtype).name:
    what = ("every weight" if FLAGS.weights == "float" else   # the linears: their blocks
            f"the weights that --weights={FLAGS.weights} keeps as floats (norms, routers)")
    print(f"  note: the checkpoint stores {stored}; --dtype={FLAGS.dtype} converts {what} "
          f"to {jnp.dtype(dtype).name} while loading (the sizes above count them in "
          f"{jnp.dtype(dtype).name}; --dtype={stored} keeps them as stored)", file=sys.stderr)
  if store_kind != "numpy" and folder is not None:   # a repack: can it fit?
    try:
      loader.check_checkpoint(folder, cfg, dtype)
    except repack.RepackError as e:
      raise cli.UsageError(str(e)) from None


def generate_resident(cfg, params, store, tok, ids, sp, dtype, seq: int) -> int:
  """Every expert on the device (no --policy): the Sampler's generation, written out."""
  from moejax.model.sampler import Sampler
  sampler = Sampler(cfg, params, store.device_experts(dtype), max_len=seq, dtype=dtype)
  print("[moejax] every expert resident (no --policy)", file=sys.stderr)
  t0 = time.time()
  out = write_text(tok, lambda on_token: sampler.generate(ids, sp, seed=FLAGS.seed,
                                                          on_token=on_token))
  dt = time.time() - t0
  print(f"[moejax] {token_count(len(out))} in {dt:.2f} s (incl. compile)", file=sys.stderr)
  return 0


def streaming() -> bool:
  """--stream, or by default whether stdout is a terminal."""
  return FLAGS.stream if FLAGS.stream is not None else sys.stdout.isatty()


def write_text(tok, generate) -> list[int]:
  """`generate(on_token)` -> the new token ids; the prompt and their text go to stdout,
  token by token as they come when `streaming()`, else at the end (the same bytes)."""
  if not streaming():
    out = generate(None)
    print(FLAGS.prompt + tok.decode(out), flush=True)
    return out
  from moejax.cli.stream import TextStream
  with TextStream(tok, sys.stdout, prefix=FLAGS.prompt) as text:
    return generate(text.add)


def token_count(n: int) -> str:
  """The number of generated tokens, and where they came from."""
  if n == 1:
    return "1 token generated (from the prompt pass)"
  return f"{n} tokens generated (1 from the prompt pass + {n - 1} decode steps)"


def load(cfg, folder, dtype, store_kind):
  """(cfg, params, store) from --model_dir (or the random model) in --store."""
  from moejax.io.loader import init_random, load_model
  from moejax.io.store import make_store
  from moejax.io.store import ExpertStore
  t0 = time.time()
  if folder is None:
    params, exps = init_random(cfg, seed=0, dtype=dtype)
    store = ExpertStore.from_stacked(exps)
  else:
    print(f"[moejax] loading {folder} ...", file=sys.stderr)
    # mmap keeps the experts on disk; pinned_host is filled from the mapped file, so the
    # experts are never in RAM twice
    cfg, params, store = load_model(folder, dtype=dtype, mmap=store_kind != "numpy",
                                    progress=FLAGS.progress, weights=FLAGS.weights)
  store = make_store(store, store_kind)
  print(f"[moejax] loaded in {time.time() - t0:.1f} s; experts in a {store_kind} store",
        file=sys.stderr)
  return cfg, params, store


def model_files(folder: str):
  """(cfg, tokenizer.json path, None or (dense, expert) bytes as a GGUF file holds them)
  of --model_dir: a Hugging Face folder or a GGUF file (the tokenizer.json beside it, else
  the file itself: `Tokenizer` builds it from the metadata)."""
  from moejax.model.config import ModelConfig
  if not folder.endswith(".gguf"):
    return ModelConfig.from_json_file(folder), os.path.join(folder, "tokenizer.json"), None
  from moejax.io.weights import gguf_file
  reader, _ = gguf_file.tensor_info(folder)
  tok = gguf_file.tokenizer_path(folder) or folder     # else the file's metadata
  return gguf_file.read_config(reader, folder), tok, gguf_file.nbytes(reader)


def predictors(cfg, folder: str | None) -> dict:
  """--prefetch's predictors (quasi, hybrid: the files made for the model in `folder`)."""
  from moejax.prefetch import speculation
  try:
    return speculation.load_predictors(FLAGS.prefetch or "none", cfg, folder,
                                       FLAGS.estimators)
  except speculation.PrefetchError as e:
    raise cli.UsageError(str(e)) from None


def generate_offloaded(cfg, held: list, store, tok, ids, sp, dtype, seq, policy, preds):
  """The OffloadEngine path under `policy` and --prefetch's `preds`: generates, then
  prints the per-token statistics table.  held: [params], handed over (emptied here), so
  that once the engine has its copy (a scanned engine stacks the layers) the loaded
  parameters are freed: no layer is held twice."""
  params = held.pop()
  import jax
  from moejax.offload.calibrate import calibrated_link
  from moejax.offload.engine import EngineConfig, OffloadEngine
  from moejax.prefetch import steps as prefetch_lib
  from moejax.offload.stats import format_stats
  link = calibrated_link(link_spec(), cfg, params, store, dtype)   # scaled: measures a layer
  prefetch = prefetch_lib.Prefetch(FLAGS.prefetch or "none", FLAGS.speculative or "off", preds,
                                   streaming=bool(FLAGS.streaming))
  policy, low = flagsets.cost_policy(policy, store)
  config = EngineConfig.make(policy, cache_fraction=None if FLAGS.cache_bytes else
                             cache_fraction(), cache_bytes=FLAGS.cache_bytes, link=link,
                             max_len=seq, dtype=dtype, prefetch=prefetch,
                             expert_devices=FLAGS.expert_devices,
                             host_cache_gb=FLAGS.host_cache_gb)
  eng = OffloadEngine(cfg, params, store, config, low_store=low)
  del params
  with eng:
    print(f"[moejax] {eng.describe()}", file=sys.stderr)
    if not link.emulated and jax.devices()[0].platform == "cpu":
      print("[moejax] note: --link=native on a CPU-only machine: a transfer is a memory copy, "
            "so offloading looks almost free; --link=scaled emulates a GPU's PCIe link",
            file=sys.stderr)
    t0 = time.time()
    eng.warmup()
    print(f"[moejax] compiled in {time.time() - t0:.2f} s", file=sys.stderr)
    t0 = time.time()
    out = write_text(tok, lambda on_token: eng.generate(ids, sp, seed=FLAGS.seed,
                                                        on_token=on_token))
    dt = time.time() - t0
    print(f"[moejax] {token_count(len(out))} in {dt:.2f} s (prefill compiles); prompt pass: "
          f"{eng.prefill_record['fetches']:.0f} experts fetched", file=sys.stderr)
    print(format_stats(eng.stats(), eng.link.describe()), file=sys.stderr)
  return 0


def entry():
  """The console script `moejax-generate`."""
  cli.run(main)


if __name__ == "__main__":
  entry()
