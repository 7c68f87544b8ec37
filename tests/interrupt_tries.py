"""Ctrl-C at a random moment of `python -m launch.generate`'s start-up, many times: the
histogram of exit codes (moejax/interrupts.py; tests/test_interrupts.py runs a few).

  nice python tests/interrupt_tries.py --tries=200 --min_s=0.2 --max_s=1.0

A crash is a negative code other than -2 (-11 SIGSEGV, -6 SIGABRT) or 134/139; a
traceback is a try whose stderr holds one (the programs answer Ctrl-C with one line).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = [sys.executable, "-m", "launch.generate", "--model_dir=ckpts/demo",
            "--policy=quality", "--max_new_tokens=8"]
CRASHES = (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS, -signal.SIGILL, 134, 135, 139)


def one_try(delay_s: float, argv=GENERATE) -> tuple[int, str]:
  """SIGINT `delay_s` after the start -> (exit status as subprocess gives it, stderr)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  # SIGINT at its default in the child, as in a terminal (a background parent ignores it)
  proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  time.sleep(delay_s)
  proc.send_signal(signal.SIGINT)
  try:
    _, err = proc.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    _, err = proc.communicate()
    return proc.returncode, "still running 60 s after SIGINT\n" + err
  return proc.returncode, err


def tries(n: int, min_s: float, max_s: float, seed: int = 0, argv=GENERATE):
  """-> (Counter of exit codes, [(delay, code, stderr) of crashes and tracebacks])."""
  rng = random.Random(seed)
  codes, bad = collections.Counter(), []
  for _ in range(n):
    delay = rng.uniform(min_s, max_s)
    code, err = one_try(delay, argv)
    codes[code] += 1
    if code in CRASHES or "Traceback" in err or "Fatal Python error" in err:
      bad.append((delay, code, err))
  return codes, bad


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tries", type=int, default=200)
  parser.add_argument("--min_s", type=float, default=0.2)
  parser.add_argument("--max_s", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  t0 = time.time()
  codes, bad = tries(args.tries, args.min_s, args.max_s, args.seed)
  print(f"{args.tries} tries, SIGINT {args.min_s}-{args.max_s} s after the start "
        f"({time.time() - t0:.0f} s): exit codes (subprocess' sign: -N = killed by signal N)")
  for code, count in sorted(codes.items()):
    print(f"  {code:>5}  {count}")
  crashes = sum(1 for _, c, _ in bad if c in CRASHES)
  print(f"crashes: {crashes}; tries with a traceback: {len(bad) - crashes}")
  for delay, code, err in bad[:5]:
    print(f"--- delay {delay:.3f} s, exit {code}:\n{err[-1500:]}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
