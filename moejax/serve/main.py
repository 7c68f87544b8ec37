"""An OpenAI-compatible server over the offload engine, the offload policy per request.

  moejax-serve --policy=quality --cache_fraction=0.25 --port=8000     # the demo model
  moejax-serve --model_dir=/path/to/Qwen3-30B-A3B --dtype=bfloat16 --store=mmap
  moejax-serve --weights=q4_0 ...       # the linears and experts in ggml's 4-bit blocks

(`python -m launch.serve` in a source checkout; needs the `serve` extra: fastapi,
uvicorn, jinja2: `.venv/bin/python -m pip install -e ".[serve]"` in a checkout.)
POST /v1/completions and /v1/chat/completions (chat only where the checkpoint's
tokenizer_config.json has a chat template), GET /v1/models, /health (200 once the model
is loaded and what the first requests run is compiled, 503 before), /metrics
(Prometheus).

One engine decodes one request at a time (batch 1), or up to --max_batch requests
together, each joining at the next token (continuous batching, moejax.serve.batching),
under the offload policy (the rows share the resident experts) or with every expert
resident (--policy=none); the others wait in a FIFO queue of --max_queue (429 with
Retry-After when full).  The expert cache (--cache_fraction
or --cache_bytes) is shared by every request and persists across them; a request may
choose its own miss policy, tau, admission and eviction in the extension object
{"moejax": {"policy": "speed"}} (docs/serve.md); each policy compiles once
(--norequest_policies: one fixed policy, those fields ignored).  --api_key (or
$MOEJAX_API_KEY) requires 'Authorization: Bearer <key>' on every route but /health.

Exit codes: 0 after a clean shutdown (SIGTERM: the running requests finish, up to 5 s);
130 Ctrl-C (the running requests are cancelled at their next token and the server stops
at once, with one line); 2 usage error (one line naming the flag, e.g. a --port in use);
1 the model failed to load, or the serve extra is not installed (the line names the pip
command for this Python).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import sys
import threading
import time

from absl import flags

from moejax.cli import app as cli
from moejax.cli import flagsets

FLAGS = flags.FLAGS
INTERRUPT_JOIN_S = 0.5    # Ctrl-C: how long the engine's thread may take to stop
INTERRUPT_LIMIT_S = 0.9   # Ctrl-C: the process ends by then whatever still runs

flagsets.model_dir(what="Hugging Face model folder (config.json, safetensors, tokenizer.json; "
                   "tokenizer_config.json for a chat template)")
flagsets.dtype()
flagsets.weights()
flagsets.engine()
flags.DEFINE_string("model_name", None, "The model id clients send (default: the folder's "
                    "name).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: a free one, printed at start).",
                     lower_bound=0, upper_bound=65535)
flags.DEFINE_string("policy", "quality", "The default offload policy: a preset (quality, "
                    "speed, baseline) or a miss rule (fetch_all, threshold, first_choice, "
                    "substitute_all, host); a request may choose another. none: every expert "
                    "resident (no offload engine), requests decoded together (--max_batch).")
flags.DEFINE_integer("max_batch", 1, "Requests decoded together, one token of each per step; "
                     "a request joins at the next token (continuous batching). Under an "
                     "offload policy the rows share the resident experts; a request under "
                     "another policy waits for the running rows to finish.", lower_bound=1)
flags.DEFINE_integer("max_len", None, "The KV cache: the longest prompt + max_tokens of a "
                     "request. Default: the model's limit, at most 2048.")
flags.DEFINE_integer("max_queue", 16, "Requests that may wait for the engine; beyond: 429.",
                     lower_bound=1)
flags.DEFINE_integer("max_policies", 8, "Distinct policies the server compiles (each is "
                     "its own program); a request for one more gets a 400.", lower_bound=1)
flags.DEFINE_list("warm_policies", [], "More policies (presets or miss rules, as a request's "
                  "moejax.policy) compiled before ready, so that a request's first use of one "
                  "does not wait for its compile (usage.moejax.compile_ms 0; ~10 s each on "
                  "the demo, 11 s for speed in issue 62).")
flags.DEFINE_float("request_timeout_s", 600.0, "A request's longest time, queue included "
                   "(a request may ask for less: moejax.timeout_s).")
flags.DEFINE_list("warm_prompt_tokens", ["all"], "Prompt lengths whose prompt pass is "
                  "compiled before /health answers 200 (one compile per bucket, 1-2 s each "
                  "on the demo; other lengths compile on first use). all: every bucket up "
                  "to --max_len (16, 32, 64, ...).")
flags.DEFINE_string("api_key", None, "Every route but /health then needs 'Authorization: "
                    "Bearer <key>' (401 otherwise). Default: $MOEJAX_API_KEY, else no key.")
flags.DEFINE_integer("cpu_spin_us", None, "CPU backend: how long the kernels' decode helper "
                     "threads stay awake after a call, in microseconds (cpu_kernel."
                     "set_spin_us). Default: $MOEJAX_CPU_SPIN_US, else 0, which hands decode "
                     "calls to XLA's pool: a spinning helper took the cores from the HTTP "
                     "event loop (docs/serve.md).", lower_bound=0)
flags.DEFINE_boolean("request_policies", True, "Whether a request may choose its offload "
                     "policy (moejax.policy, tau, admission_beta, eviction); false: those "
                     "fields are ignored and every request runs under --policy.")


def spin_us() -> int:
  """--cpu_spin_us, else $MOEJAX_CPU_SPIN_US, else 0 (see the flag)."""
  if FLAGS.cpu_spin_us is not None:
    return FLAGS.cpu_spin_us
  env = os.environ.get("MOEJAX_CPU_SPIN_US", "0").strip() or "0"
  if not env.isdigit():
    raise cli.UsageError(f"MOEJAX_CPU_SPIN_US must be microseconds >= 0, got {env!r}")
  return int(env)


def check_flags(cfg):
  if cli.given("cache_fraction") and cli.given("cache_bytes"):
    raise cli.UsageError("--cache_fraction and --cache_bytes both set the expert budget; "
                         "give one")
  if not FLAGS.request_timeout_s > 0:
    raise cli.UsageError(f"--request_timeout_s must be > 0, got {FLAGS.request_timeout_s}")
  limit = cfg.max_position_embeddings
  max_len = FLAGS.max_len if FLAGS.max_len is not None else min(limit, 2048)
  if max_len < 2:
    raise cli.UsageError(f"--max_len must be >= 2, got {max_len}")
  from moejax.serve import warm as warm_lib
  try:
    warm = warm_lib.prompt_lengths(FLAGS.warm_prompt_tokens, max_len)
  except ValueError as e:
    raise cli.UsageError(f"--warm_prompt_tokens={','.join(FLAGS.warm_prompt_tokens)}: {e}; "
                         "give integers, or all") from None
  if FLAGS.policy == "none":
    for name in ("cache_fraction", "cache_bytes", "tau", "admission_beta", "eviction",
                 "host_cache_gb"):
      if cli.given(name):
        raise cli.UsageError(f"--{name} sets the offload engine; --policy=none keeps every "
                             "expert resident: drop it")
    if FLAGS.warm_policies:
      raise cli.UsageError("--warm_policies compiles offload policies; --policy=none keeps "
                           "every expert resident: drop it")
    check_batch(cfg, max_len)
    return max_len, warm, None
  if FLAGS.max_batch > 1 and FLAGS.host_cache_gb is not None:
    raise cli.UsageError(f"--max_batch={FLAGS.max_batch} with --host_cache_gb: the host staging "
                         "tier reads one sequence's experts; drop one of the two")
  if FLAGS.host_cache_gb is not None:   # a size or store that cannot work: before loading
    import jax.numpy as jnp
    from moejax.io import staging
    from moejax.io.weights import quantized
    from moejax.offload.memory import expert_nbytes
    staging.staging_rows(FLAGS.host_cache_gb, quantized.expert_nbytes(cfg, FLAGS.weights)
                         if FLAGS.weights != "float" else
                         expert_nbytes(cfg, jnp.dtype(FLAGS.dtype)),
                         len(cfg.moe_layers), FLAGS.store or "numpy")
  from moejax.cache.policy import make_policy
  policy = make_policy(FLAGS.policy, tau=FLAGS.tau, admission_beta=FLAGS.admission_beta,
                       eviction=FLAGS.eviction)
  more = [make_policy(name) for name in FLAGS.warm_policies]
  if len({policy, *more}) > FLAGS.max_policies:
    raise cli.UsageError(f"--warm_policies={','.join(FLAGS.warm_policies)}: with --policy that "
                         f"is more than --max_policies={FLAGS.max_policies}")
  if FLAGS.max_batch > 1:
    check_batch(cfg, max_len, offload=True)
  return max_len, warm, policy


def check_batch(cfg, max_len: int, offload: bool = False) -> None:
  """--max_batch rows of --max_len KV cache beside the model (resident, or the offload
  engine's plan) must fit in the memory there is (host RAM on the CPU backend, the
  device's elsewhere): else one line naming the largest --max_batch that fits."""
  import jax
  import jax.numpy as jnp
  from moejax.offload import memory
  fraction = 0.25 if FLAGS.cache_fraction is None else FLAGS.cache_fraction
  plan = memory.plan_memory(cfg, jnp.dtype(FLAGS.dtype), store=FLAGS.store or "numpy",
                            offload=offload, kv_len=max_len,
                            cache_fraction=None if FLAGS.cache_bytes else fraction,
                            cache_bytes=FLAGS.cache_bytes, weights=FLAGS.weights)
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    need, have, where = plan.anon_bytes, memory.available_ram(), "RAM available"
  else:
    need, have, where = plan.device_bytes, (dev.memory_stats() or {}).get("bytes_limit"), \
        "device memory"
  if not have:
    return
  fits = 1 + max(have - need, 0) // max(plan.kv_bytes, 1) if need <= have else 0
  if FLAGS.max_batch > fits:
    raise cli.UsageError(
        f"--max_batch={FLAGS.max_batch}: the {'offloaded' if offload else 'resident'} model "
        f"({memory.gb(need)} with one "
        f"request's KV cache of {memory.gb(plan.kv_bytes)} at --max_len={max_len}) and "
        f"{FLAGS.max_batch} rows need more than the {memory.gb(have)} of {where}; the "
        f"largest --max_batch that fits is {fits}" + (" (none: lower --max_len)" if not fits
                                                       else ""))


def model_folder() -> str:
  return cli.model_folder(FLAGS.model_dir)


def listen() -> socket.socket:
  """The listening socket, bound now: a port in use is a usage error before loading."""
  family = socket.AF_INET6 if ":" in FLAGS.host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((FLAGS.host, FLAGS.port))
  except OSError as e:
    sock.close()
    raise cli.UsageError(f"--host={FLAGS.host} --port={FLAGS.port}: cannot listen there "
                         f"({e.strerror}); choose another --port (0 picks a free one)") from None
  sock.listen(128)
  return sock


def loader(folder, tok, template, max_len, warm, policy):
  """The worker's loading step: weights, link, engine, compiles."""
  def load():
    import jax.numpy as jnp
    from moejax.io.loader import load_model
    from moejax.io.store import make_store
    from moejax.offload.calibrate import calibrated_link
    from moejax.offload.engine import EngineConfig, OffloadEngine
    from moejax.serve.worker import Loaded
    import jax
    t0 = time.time()
    dtype = jnp.dtype(FLAGS.dtype)
    store_kind = FLAGS.store or "numpy"
    cfg, params, store = load_model(folder, dtype=dtype, mmap=store_kind != "numpy",
                                    weights=FLAGS.weights)
    store = make_store(store, store_kind)
    if policy is None:            # --policy=none: the resident model, requests batched
      from moejax.model.sampler import Sampler
      from moejax.serve.batching import Resident
      res = Resident(Sampler(cfg, params, store.device_experts(dtype), max_len=max_len,
                             dtype=dtype), store, FLAGS.max_batch)
      print(f"[moejax] {res.describe()}; KV cache {max_len} positions a request", file=sys.stderr)
      res.warmup(prompt_lengths=warm)
      print(f"[moejax] ready: loaded and compiled in {time.time() - t0:.1f} s", file=sys.stderr,
            flush=True)
      return Loaded(res, tok, cfg, template)
    from moejax.offload.link import default_spec
    spec = FLAGS.link or default_spec(jax.devices()[0].platform)
    link = calibrated_link(spec, cfg, params, store, dtype)
    fraction = 0.25 if FLAGS.cache_fraction is None else FLAGS.cache_fraction
    config = EngineConfig.make(policy, cache_fraction=None if FLAGS.cache_bytes else fraction,
                               cache_bytes=FLAGS.cache_bytes, link=link, max_len=max_len,
                               dtype=dtype, host_cache_gb=FLAGS.host_cache_gb)
    eng = OffloadEngine(cfg, params, store, config)
    if FLAGS.max_batch > 1:       # requests decoded together on the engine's experts
      from moejax.serve.batching import Offloaded
      eng = Offloaded(eng, FLAGS.max_batch)
    print(f"[moejax] {eng.describe()}; KV cache {max_len} positions", file=sys.stderr)
    eng.warmup(prompt_lengths=warm)
    from moejax.serve import warm as warm_lib
    if FLAGS.max_batch == 1:      # (a batch's warmup compiles its sampler itself)
      warm_lib.sampling(cfg.vocab_size)
    warmed = warm_lib.policies(eng, policy, FLAGS.warm_policies, warm)
    print(f"[moejax] ready: loaded and compiled in {time.time() - t0:.1f} s", file=sys.stderr,
          flush=True)
    return Loaded(eng, tok, cfg, template, warmed)
  return load


def install_hint() -> str:
  """The command that installs the serve extra into the Python running this program (a
  bare `pip` may be another Python's): in a source checkout (or an editable install) the
  checkout with its extra, else moejax's."""
  py = shlex.quote(sys.executable)
  if os.path.isfile(os.path.join(cli.CHECKOUT, "pyproject.toml")):
    here = os.path.abspath(os.getcwd()) == cli.CHECKOUT
    return f"{py} -m pip install -e {shlex.quote(('.' if here else cli.CHECKOUT) + '[serve]')}"
  return f"{py} -m pip install 'moejax[serve]'"


def need_serve_extra():
  """uvicorn, once fastapi, uvicorn and jinja2 import; else MissingExtra (exit 1) naming
  the missing ones and `install_hint()`."""
  import importlib
  from moejax.extras import MissingExtra
  missing = []
  for name in ("fastapi", "uvicorn", "jinja2"):
    try:
      importlib.import_module(name)
    except ImportError:
      missing.append(name)
  if missing:
    raise MissingExtra(f"the server needs {', '.join(missing)} (the serve extra), not "
                       f"installed for {sys.executable}; install it with: {install_hint()}")
  return importlib.import_module("uvicorn")


def serve_until_signal(server, sock, worker, app) -> bool:
  """uvicorn on `sock` until SIGTERM or Ctrl-C -> whether it was Ctrl-C.  SIGTERM is
  graceful: open requests may finish (up to 5 s).  Ctrl-C is prompt: every running
  request is ended at once (`Completions.stop_all`: cancelled at its next token, its
  client answered 503 shutting_down), the server closes, and the engine's thread gets
  INTERRUPT_JOIN_S; a second Ctrl-C, or INTERRUPT_LIMIT_S after the first, ends the
  process where it is.  (uvicorn's own handlers waited for every open stream, 4 s in
  issue 62, and then exited 0 with nothing printed.)"""
  got = []

  def on_signal(signum, frame):
    del frame
    if signum == signal.SIGINT and signal.SIGINT in got:
      cli.interrupted_exit()
    got.append(signum)
    server.should_exit = True
    if signum != signal.SIGINT:
      return
    limit = threading.Timer(INTERRUPT_LIMIT_S, cli.interrupted_exit)
    limit.daemon = True
    limit.start()
    try:
      asyncio.get_running_loop().call_soon_threadsafe(app.stop_all)
    except RuntimeError:            # not serving yet, or any more
      pass

  server.capture_signals = contextlib.nullcontext      # these handlers, not uvicorn's
  old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    server.run(sockets=[sock])
  finally:
    interrupted = signal.SIGINT in got
    worker.stop(INTERRUPT_JOIN_S if interrupted else 5.0)
    for s, handler in old.items():
      signal.signal(s, handler)
  return interrupted


def main(_):
  folder = model_folder()
  uvicorn = need_serve_extra()
  from moejax.io.tokenizer import Tokenizer
  from moejax.model.config import ModelConfig
  from moejax.serve import app as app_lib
  from moejax.serve import auth
  from moejax.serve import chat, metrics as metrics_lib, protocol
  from moejax.serve.worker import Worker
  cfg = ModelConfig.from_json_file(folder)
  max_len, warm, policy = check_flags(cfg)
  if not os.path.exists(os.path.join(folder, "tokenizer.json")):
    raise cli.UsageError(f"--model_dir={folder!r} has no tokenizer.json")
  tok = Tokenizer(folder)
  try:
    template = chat.load_template(folder)
  except chat.TemplateError as e:
    raise cli.UsageError(str(e)) from None
  model_id = FLAGS.model_name or os.path.basename(os.path.normpath(folder))
  limits = protocol.Limits(model_id, max_len, FLAGS.request_timeout_s, policy,
                           tuple(cfg.eos_token_ids),
                           request_policies=FLAGS.request_policies and policy is not None)
  key = auth.resolve_key(FLAGS.api_key)
  from moejax.kernels import cpu_kernel
  cpu_kernel.set_spin_us(spin_us())
  sock = listen()
  metrics = metrics_lib.Metrics()
  # no lifespan (the app has no start-up or shutdown hooks): Ctrl-C's forced exit would
  # otherwise cancel the lifespan task, which Starlette prints as a traceback
  config = uvicorn.Config(None, log_level="warning", timeout_graceful_shutdown=5,
                          lifespan="off")
  server = uvicorn.Server(config)

  def on_fail(e):
    print(f"[moejax] loading failed: {e}", file=sys.stderr)
    server.should_exit = True

  worker = Worker(loader(folder, tok, template, max_len, warm, policy), metrics,
                  max_queue=FLAGS.max_queue, max_policies=FLAGS.max_policies, on_fail=on_fail)
  config.app = app_lib.create_app(worker, limits, metrics, tok, template, auth.Guard(key))
  host, port = sock.getsockname()[:2]
  # uvicorn's "auto" takes uvloop and httptools when installed (the serve extra): without
  # them the first token comes ~0.7 ms later (docs/serve.md), so say which run
  import importlib.util
  stack = "/".join(name if importlib.util.find_spec(name) else fallback for name, fallback in
                   (("uvloop", "asyncio"), ("httptools", "h11")))
  warning = auth.exposure_warning(FLAGS.host, key)
  if warning:                     # first, so that it is not lost among the load's lines
    print(warning, file=sys.stderr, flush=True)
  print(f"[moejax] serving {model_id!r} on http://{host}:{port} (chat: "
        f"{'yes' if template else 'no, no chat template'}; {stack}); loading ...",
        file=sys.stderr, flush=True)
  worker.start()
  if serve_until_signal(server, sock, worker, config.app):
    cli.interrupted_exit()         # "<program>: interrupted", exit 130
  if worker.failed is not None:
    raise worker.failed
  return 0


def entry():
  """The console script `moejax-serve` (and `python -m launch.serve` from a checkout)."""
  cli.run(main)


if __name__ == "__main__":
  entry()
