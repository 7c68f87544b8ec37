"""Command-line plumbing of the user-facing programs (moejax.cli.*, run as `moejax-X` when
installed, or launch/X.py from a checkout): errors a user can act on.

  exit 0  success (also --help)
  exit 2  usage error: the command line is wrong (a flag's value, a flag that does not
          apply, a --model_dir that is not a model folder); one line naming the flag,
          and a pointer to --help
  exit 1  runtime failure: e.g. a corrupt checkpoint; one line naming the file and
          tensor (the traceback only with --verbose)
  exit 130  interrupted (Ctrl-C / SIGINT; 128 + 2, the shell's convention): one line,
          no traceback.  At any moment once `run` has started, compilation included:
          KeyboardInterrupt unwinds the script (finally blocks and atexit handlers run;
          the interpreter's finalization is skipped), and a watchdog ends the process
          with os._exit(130) if it is still alive INTERRUPT_GRACE_S after the signal (the
          main thread held in C++ by XLA, where Python's handler cannot run, or an
          interrupt swallowed where exceptions are ignored, e.g. in JAX's gc callback).  Only the interpreter's
          first ~0.1 s of start-up, before `run`, ends by the signal itself (status -2,
          which a shell also shows as 130).

    from moejax.cli import app as cli
    ...
    def entry():                # the console script's target
      cli.run(main)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

from absl import app, flags

from moejax.extras import MissingExtra

FLAGS = flags.FLAGS
EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPT = 1, 2, 130
INTERRUPT_GRACE_S = 0.7       # the watchdog's wait after SIGINT before os._exit(130)
HELP_ARGS = ("-h", "-?", "--help", "--helpshort", "--helpfull")

flags.DEFINE_bool("verbose", False, "Print tracebacks of checkpoint errors and more detail.")


class UsageError(Exception):
  """The command line is wrong; the message names the flag and what to do."""


def prog() -> str:
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return f"python -m {spec.name}"
  return os.path.basename(sys.argv[0]) or "moejax"


def usage_exit(msg: str):
  """Prints `msg` as one line (plus the --help pointer) and exits with 2."""
  sys.stderr.write(f"{prog()}: error: {msg}\nRun `{prog()} --help` for the flags.\n")
  sys.exit(EXIT_USAGE)


def failure_exit(msg: str):
  sys.stderr.write(f"{prog()}: error: {msg}\n")
  if FLAGS.is_parsed() and FLAGS.verbose:
    traceback.print_exc()
  else:
    sys.stderr.write("(run with --verbose for the traceback)\n")
  sys.exit(EXIT_FAILURE)


_program = {"module": None}    # the module whose `main` `run` runs (its flags make --help)


def print_help(full: bool = False):
  """The program's docstring and its flags (the module's own and those it adopted), or
  with `full` every flag.  absl's short help lists the flags of `__main__`, which is
  the thin launch/X.py or the console script, not the module that defines them."""
  module = sys.modules.get(_program["module"] or "__main__")
  if full or module is None:
    app.usage(shorthelp=not full, writeto_stdout=True)
    return
  doc = (module.__doc__ or "").strip()
  own = FLAGS.module_help(module.__name__)
  text = f"{doc}\n\nflags:\n{own}\n{FLAGS.module_help(__name__)}\n"   # + --verbose
  text += "\n(--helpfull lists every flag, absl's own included)\n"
  sys.stdout.write(text)
  sys.stdout.flush()


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with --help exiting 0 and parse errors as one line, exit 2."""
  if any(a in HELP_ARGS for a in argv[1:]):
    print_help(full="--helpfull" in argv)
    sys.exit(0)
  try:
    rest = FLAGS(argv)
  except flags.Error as e:
    usage_exit(str(e).splitlines()[0])
  if FLAGS["verbosity"].using_default_value and not FLAGS.verbose:
    FLAGS.verbosity = -1          # absl's INFO lines (e.g. which backends jax tried) are noise
  if len(rest) > 1:
    usage_exit(f"unexpected argument {rest[1]!r}: every input is a flag, e.g. --prompt='...'")
  return rest


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def demo_model_dir() -> str:
  """The shipped demo model, for a program run without --model_dir: ./ckpts/demo under
  the current folder, else the source checkout's (a checkout, or an editable install).
  Neither: UsageError (exit 2) saying where the model comes from."""
  for root in (os.getcwd(), CHECKOUT):
    d = os.path.join(root, "ckpts", "demo")
    if os.path.isfile(os.path.join(d, "config.json")):
      return d
  raise UsageError("no --model_dir given and no ./ckpts/demo here: the demo model ships with "
                   "the source checkout (run from its folder), else pass "
                   "--model_dir=/path/to/a/Hugging Face model folder")


def model_folder(model_dir: str | None) -> str:
  """--model_dir (default: the demo model), checked to be a model folder (UsageError,
  exit 2, otherwise)."""
  d = model_dir if model_dir is not None else demo_model_dir()
  if d.endswith(".gguf"):         # a GGUF file: its architecture and types checked now
    from moejax.io.weights import gguf_file
    gguf_file.tensor_info(d)
    return d
  if not os.path.exists(d):
    raise UsageError(f"--model_dir={d!r}: no such folder (use --random_model for a "
                     "random-weight model)")
  if not os.path.isdir(d):
    raise UsageError(f"--model_dir={d!r} is a file; give the folder that holds config.json")
  if not os.path.exists(os.path.join(d, "config.json")):
    raise UsageError(f"--model_dir={d!r} has no config.json: not a Hugging Face model "
                     "folder")
  return d


def given(name: str) -> bool:
  """Whether the user set flag `name` on the command line."""
  return FLAGS[name].present > 0


def user_errors() -> tuple[type, ...]:
  """Errors whose message names the flag at fault: usage errors (exit 2)."""
  from moejax.io.store import StoreBackendError
  from moejax.offload.link import LinkSpecError
  from moejax.cache.policy import PolicyError
  from moejax.cache.resident import BudgetError
  from moejax.offload.expert_parallel import ExpertParallelError
  from moejax.io.weights.gguf_file import GGUFUnsupported
  return (UsageError, app.UsageError, PolicyError, BudgetError, LinkSpecError, StoreBackendError,
          ExpertParallelError, GGUFUnsupported)


def checkpoint_errors() -> tuple[type, ...]:
  """Errors whose message names the file (and tensor) at fault: runtime failures (exit 1)."""
  from moejax.model.config import ConfigError
  from moejax.io.safetensors_io import CheckpointError
  from moejax.io.tokenizer import TokenizerError
  return (CheckpointError, ConfigError, TokenizerError)


# ------------------------------------------------------------------------ Ctrl-C
_interrupt = {"seen": False, "reported": False, "timer": None}
_interrupt_lock = threading.RLock()    # reentrant: the handler may run while main holds it


def interrupted() -> bool:
  """Whether SIGINT has arrived since `run` installed its handler."""
  return _interrupt["seen"]


def _say_interrupted():
  """The one line, once (whoever ends the process first writes it)."""
  with _interrupt_lock:
    if _interrupt["reported"]:
      return
    _interrupt["reported"] = True
  try:
    # On a line of its own even when the signal split a print (its text written, its
    # newline not yet): print() writes the two separately.
    start = "" if getattr(sys.stderr, "at_line_start", True) else "\n"
    sys.stderr.write(f"{start}{prog()}: interrupted\n")
    sys.stderr.flush()
  except Exception:  # pylint: disable=broad-except
    pass


def _watchdog_exit():
  _say_interrupted()
  os._exit(EXIT_INTERRUPT)


def _arm_watchdog():
  with _interrupt_lock:
    _interrupt["seen"] = True
    if _interrupt["timer"] is None:
      t = threading.Timer(INTERRUPT_GRACE_S, _watchdog_exit)
      t.daemon = True
      t.name = "moejax-interrupt-watchdog"
      _interrupt["timer"] = t
      t.start()


def _on_sigint(signum, frame):
  del signum, frame
  _arm_watchdog()
  raise KeyboardInterrupt


def _watch_wakeup_fd(fd: int):
  """Arms the watchdog at the signal itself: Python runs `_on_sigint` only when the main
  thread is back in bytecode (not while it waits in C++ for an XLA compile or
  computation), but the C-level handler writes the signal number to the wakeup fd at
  once, and this thread reads it (those waits release the GIL)."""
  while True:
    try:
      data = os.read(fd, 64)
    except OSError:
      return
    if not data:
      return
    if int(signal.SIGINT) in data:
      _arm_watchdog()


def _redeliver():
  import _thread
  import time
  time.sleep(0.005)            # let the main thread leave the callback and the hook
  _thread.interrupt_main(signal.SIGINT)


def _schedule_redelivery():
  threading.Thread(target=_redeliver, daemon=True, name="moejax-sigint-redeliver").start()


def _unraisable(hook):
  """sys.unraisablehook that re-delivers a swallowed KeyboardInterrupt (e.g. raised in
  JAX's gc callback, where exceptions are ignored) to the main thread, silently: from
  another thread a moment later, once the main thread has left the callback (if it lands
  in one again, it comes back here; the watchdog bounds the loop)."""
  def wrapped(unraisable):
    try:
      if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        hook(unraisable)
        return
      _arm_watchdog()
      _schedule_redelivery()
    except KeyboardInterrupt:  # landed in here: deliver it again (the watchdog is armed)
      try:
        _schedule_redelivery()
      except BaseException:  # pylint: disable=broad-except
        pass
  return wrapped


class _LineTracking:
  """sys.stderr that remembers whether its last write ended a line (for the one line)."""

  def __init__(self, stream):
    self._stream, self.at_line_start = stream, True

  def write(self, text):
    if text:
      self.at_line_start = text.endswith("\n")
    return self._stream.write(text)

  def __getattr__(self, name):
    return getattr(self._stream, name)


def install_interrupt_handler():
  """SIGINT -> KeyboardInterrupt plus the watchdog (see the module docstring).  Main
  thread only; `run` calls it first.  A process started with SIGINT ignored (e.g. `cmd &`
  in a script) keeps ignoring it."""
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    return
  signal.signal(signal.SIGINT, _on_sigint)
  r, w = os.pipe()
  os.set_blocking(w, False)
  signal.set_wakeup_fd(w, warn_on_full_buffer=False)
  threading.Thread(target=_watch_wakeup_fd, args=(r,), daemon=True,
                   name="moejax-sigint-wakeup").start()
  sys.unraisablehook = _unraisable(sys.unraisablehook)
  if not isinstance(sys.stderr, _LineTracking):
    sys.stderr = _LineTracking(sys.stderr)


def interrupted_exit():
  """Prints the one line and ends the process with 130, once the script has unwound (its
  finally blocks ran): atexit handlers run (the watchdog still armed), then os._exit
  skips the interpreter's finalization, which can wait on (and crash in) an XLA compile
  still running on another thread."""
  _arm_watchdog()
  _say_interrupted()
  try:
    import atexit
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    for f in (sys.stdout, sys.stderr):
      f.flush()
  except BaseException:  # pylint: disable=broad-except
    pass
  os._exit(EXIT_INTERRUPT)


def compile_cache_dir() -> str | None:
  """Where the programs keep XLA's compiled executables between runs, so that a second
  start with the same model, policy and shapes loads its decode step instead of compiling
  it: $JAX_COMPILATION_CACHE_DIR when set (jax reads it itself), else <cache>/xla under
  $MOEJAX_CACHE_DIR or ~/.cache/moejax; None with MOEJAX_COMPILE_CACHE=0."""
  if os.environ.get("MOEJAX_COMPILE_CACHE", "1").strip() == "0":
    return None
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  from moejax.io.repack import cache_root
  return os.path.join(cache_root(), "xla")


def enable_compile_cache():
  """jax's persistent compilation cache at `compile_cache_dir()` (programs that compile
  in under a second are not kept), through jax's own environment variables, read when jax
  is imported: a program that never imports jax does not import it here (its gc callback
  would then run at every collection)."""
  d = compile_cache_dir()
  if d is None or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  os.environ["JAX_COMPILATION_CACHE_DIR"] = d
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")
  if "jax" in sys.modules:          # already imported: its config read them before
    import jax
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def run(main):
  """app.run(main) with the exit codes and one-line errors of the module docstring, and
  the persistent compilation cache (`enable_compile_cache`)."""
  _program["module"] = main.__module__
  install_interrupt_handler()

  def wrapped(argv):
    try:
      enable_compile_cache()
      return main(argv)
    except (UsageError, app.UsageError) as e:
      usage_exit(str(e))
    except Exception as e:  # pylint: disable=broad-except
      if interrupted():          # e.g. an interrupt that surfaced as another error
        interrupted_exit()
      if isinstance(e, user_errors()):
        if FLAGS.verbose:
          traceback.print_exc()
        usage_exit(str(e))
      if isinstance(e, checkpoint_errors() + (MissingExtra,)):
        failure_exit(str(e))
      raise

  try:
    app.run(wrapped, flags_parser=parse_flags)
  except KeyboardInterrupt:
    interrupted_exit()
  except SystemExit:
    if interrupted():            # main finished (or failed) after a swallowed interrupt
      interrupted_exit()
    raise
