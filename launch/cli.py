"""Command-line plumbing of the user-facing launch scripts: errors a user can act on.

  exit 0  success (also --help)
  exit 2  usage error: the command line is wrong (a flag's value, a flag that does not
          apply, a --model_dir that is not a model folder); one line naming the flag,
          and a pointer to --help
  exit 1  runtime failure: e.g. a corrupt checkpoint; one line naming the file and
          tensor (the traceback only with --verbose)

    from launch import cli
    ...
    if __name__ == "__main__":
      cli.run(main)
"""

from __future__ import annotations

import os
import sys
import traceback

from absl import app, flags

FLAGS = flags.FLAGS
EXIT_FAILURE, EXIT_USAGE = 1, 2
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


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with --help exiting 0 and parse errors as one line, exit 2."""
  if any(a in HELP_ARGS for a in argv[1:]):
    app.usage(shorthelp="--helpfull" not in argv, writeto_stdout=True)
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


def given(name: str) -> bool:
  """Whether the user set flag `name` on the command line."""
  return FLAGS[name].present > 0


def user_errors() -> tuple[type, ...]:
  """Errors whose message names the flag at fault: usage errors (exit 2)."""
  from moejax.offload.host_experts import HostComputeError
  from moejax.offload.host_store import StoreBackendError
  from moejax.offload.link import LinkSpecError
  from moejax.offload.policy import PolicyError
  from moejax.offload.resident import BudgetError
  return (UsageError, app.UsageError, PolicyError, BudgetError, LinkSpecError, StoreBackendError,
          HostComputeError)


def checkpoint_errors() -> tuple[type, ...]:
  """Errors whose message names the file (and tensor) at fault: runtime failures (exit 1)."""
  from moejax.config import ConfigError
  from moejax.safetensors_io import CheckpointError
  from moejax.tokenizer import TokenizerError
  return (CheckpointError, ConfigError, TokenizerError)


def run(main):
  """app.run(main) with the exit codes and one-line errors of the module docstring."""
  def wrapped(argv):
    try:
      return main(argv)
    except (UsageError, app.UsageError) as e:
      usage_exit(str(e))
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(e, user_errors()):
        if FLAGS.verbose:
          traceback.print_exc()
        usage_exit(str(e))
      if isinstance(e, checkpoint_errors()):
        failure_exit(str(e))
      raise
  app.run(wrapped, flags_parser=parse_flags)
