"""Ctrl-C ends a user-facing command within a second, with exit code 130 and one line.

The bug: SIGINT about 0.3 s after launch.generate's `[moejax] policy` line was ignored in
4 of 10 tries: the KeyboardInterrupt landed in JAX's `_xla_gc_callback` ("Exception
ignored in ..."), generation ran to the end, exit 0.  `moejax.cli.app.run` now turns SIGINT
into KeyboardInterrupt plus a watchdog that ends the process with os._exit(130) if it is
still alive cli.INTERRUPT_GRACE_S after the signal.
"""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")
LIMIT_S = 1.5            # signal -> process gone


class Proc:
  """A subprocess whose stderr (and optionally stdout) lines are read as they come."""

  def __init__(self, argv, env=None, stdout=False):
    # SIGINT at its default in the child: a test run started in the background (`cmd &`
    # in a script, nohup) ignores it, and a process started so keeps ignoring it (moejax/cli/app.py)
    self.p = subprocess.Popen(argv, cwd=REPO, env=env, text=True, stdin=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                              stderr=subprocess.PIPE,
                              stdout=subprocess.PIPE if stdout else subprocess.DEVNULL)
    self.lines, self.err, self.out = queue.Queue(), [], []
    self.readers = [threading.Thread(target=self._read, args=(self.p.stderr, self.err, True),
                                     daemon=True)]
    if stdout:
      self.readers.append(threading.Thread(target=self._read,
                                           args=(self.p.stdout, self.out, False), daemon=True))
    for t in self.readers:
      t.start()

  def _read(self, f, store, signal_lines):
    for line in f:
      store.append(line)
      if signal_lines:
        self.lines.put(line)
    if signal_lines:
      self.lines.put(None)

  def wait_for(self, needle, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
      try:
        line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        self.p.kill()
        pytest.fail(f"no stderr line with {needle!r} in {timeout} s: {''.join(self.err)}")
      if line is None:
        pytest.fail(f"exited ({self.p.wait()}) before a line with {needle!r}: "
                    f"{''.join(self.err)}")
      if needle in line:
        return

  def interrupt(self, delay=0.0):
    """SIGINT after `delay` s; returns (returncode, seconds from the signal to the exit)."""
    time.sleep(delay)
    t0 = time.monotonic()
    self.p.send_signal(signal.SIGINT)
    try:
      rc = self.p.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self.p.kill()
      pytest.fail(f"still running 30 s after SIGINT: {''.join(self.err)}")
    dt = time.monotonic() - t0
    for t in self.readers:
      t.join(timeout=5)
    return rc, dt

  def stderr(self):
    return "".join(self.err)


def assert_interrupted(proc, rc, dt, prog):
  err = proc.stderr()
  assert rc == 130, (rc, err)
  assert dt < LIMIT_S, (dt, err)
  assert "Traceback" not in err and "Exception ignored" not in err, err
  assert err.strip().splitlines()[-1] == f"{prog}: interrupted", err


# ------------------------------------------------------------- launch.generate end to end
def generate_env():
  env = dict(os.environ)
  # no persistent compilation cache: the warm-up compiles for the whole test, so a signal
  # 1 s after the policy line still lands before the first token
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


GENERATE = [sys.executable, "-m", "launch.generate", f"--model_dir={DEMO}", "--policy=quality",
            "--max_new_tokens=16", "--prompt=def f(x):"]


@pytest.mark.parametrize("after,delay", [
    ("memory needed", 0.0),             # loading (jax imported, nothing compiled yet)
    ("[moejax] policy", 0.0),           # the warm-up compiles, from here on
    ("[moejax] policy", 0.3),           # the reported case (ignored in 4 of 10 tries)
    ("[moejax] policy", 1.0),
])
def test_generate_interrupted_exits_130_within_a_second(after, delay):
  proc = Proc(GENERATE, env=generate_env())
  proc.wait_for(after)
  rc, dt = proc.interrupt(delay)
  assert_interrupted(proc, rc, dt, "python -m launch.generate")


# ------------------------------------------------------- the mechanism, on tiny scripts
PRELUDE = """
import sys, time
from moejax.cli import app as cli

def say(msg):
  sys.stderr.write(msg + "\\n")
  sys.stderr.flush()
"""


def run_script(tmp_path, body, ready="ready"):
  path = tmp_path / "script.py"
  path.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(body) +
                  "\nif __name__ == '__main__':\n  cli.run(main)\n")
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)      # the compile below must take seconds
  proc = Proc([sys.executable, str(path)], env=env, stdout=True)
  proc.wait_for(ready, timeout=60)
  return proc


def test_interrupt_swallowed_in_a_loop_still_exits_130(tmp_path):
  # every KeyboardInterrupt is swallowed (as in a gc callback): the watchdog ends it
  proc = run_script(tmp_path, """
  def main(argv):
    say("ready")
    while True:
      try:
        time.sleep(0.01)
      except KeyboardInterrupt:
        pass
  """)
  rc, dt = proc.interrupt(0.1)
  assert_interrupted(proc, rc, dt, "script.py")
  from moejax.cli import app as cli
  assert dt >= cli.INTERRUPT_GRACE_S * 0.9, dt      # it was the watchdog


def test_interrupt_between_a_lines_text_and_its_newline(tmp_path):
  # print() writes its text and its newline separately; a signal between the two (CI saw
  # it after generate's "host RAM ..." line) must still leave the one line on its own line
  proc = run_script(tmp_path, """
  def main(argv):
    say("ready")
    sys.stderr.write("half a line")
    sys.stderr.flush()
    time.sleep(30)
  """)
  rc, dt = proc.interrupt(0.1)
  assert_interrupted(proc, rc, dt, "script.py")
  assert "half a line\n" in proc.stderr()


def test_interrupt_unwinds_finally_blocks_and_exits_130(tmp_path):
  proc = run_script(tmp_path, """
  def main(argv):
    try:
      say("ready")
      time.sleep(30)
    finally:
      print("cleanup ran", flush=True)
  """)
  rc, dt = proc.interrupt(0.1)
  assert_interrupted(proc, rc, dt, "script.py")
  assert "cleanup ran\n" in proc.out
  assert dt < 0.5, dt            # KeyboardInterrupt, not the watchdog


def test_interrupt_swallowed_by_a_gc_callback_is_redelivered(tmp_path):
  # like JAX's _xla_gc_callback: a KeyboardInterrupt raised in a gc callback is ignored by
  # Python.  The script sends itself SIGINT from inside one, so the interrupt lands there;
  # cli re-delivers it to the main thread, and the script unwinds (its finally runs)
  # without the "Exception ignored" report, well before the watchdog
  proc = run_script(tmp_path, """
  import gc, os, signal

  armed = []

  def callback(phase, info):
    if phase == "start" and armed and armed.pop():
      try:
        os.kill(os.getpid(), signal.SIGINT)
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
          pass
      except KeyboardInterrupt:
        say("interrupt raised in the gc callback")
        raise

  def main(argv):
    gc.callbacks.append(callback)
    try:
      say("ready")
      armed.append(True)
      while True:
        gc.collect()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.01:
          pass
    finally:
      print("cleanup ran", flush=True)
  """)
  t0 = time.monotonic()
  rc = proc.p.wait(timeout=30)
  dt = time.monotonic() - t0
  for t in proc.readers:
    t.join(timeout=5)
  assert_interrupted(proc, rc, dt, "script.py")
  assert "interrupt raised in the gc callback" in proc.stderr()
  assert "cleanup ran\n" in proc.out
  from moejax.cli import app as cli
  assert dt < cli.INTERRUPT_GRACE_S, dt      # re-delivered, not the watchdog


def test_interrupt_during_a_long_xla_compile(tmp_path):
  # Python runs signal handlers only between bytecodes: during a compile (C++, GIL
  # released) only the wakeup-fd thread sees the signal and arms the watchdog
  proc = run_script(tmp_path, """
  def main(argv):
    import jax
    import jax.numpy as jnp

    def f(x):
      for i in range(400):
        x = jnp.sin(x @ x.T) + i
      return x

    lowered = jax.jit(f).lower(jnp.ones((64, 64)))
    say("ready")
    t0 = time.perf_counter()
    lowered.compile()
    say(f"compiled in {time.perf_counter() - t0:.1f} s")
  """)
  rc, dt = proc.interrupt(0.2)
  assert_interrupted(proc, rc, dt, "script.py")
  assert "compiled in" not in proc.stderr()


def test_interrupt_while_blocked_in_a_long_xla_computation(tmp_path):
  # block_until_ready waits in C++ (GIL released) and never returns to Python until the
  # computation ends: the wakeup-fd thread alone sees the signal; the watchdog ends it
  proc = run_script(tmp_path, """
  def main(argv):
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, x: jnp.sin(x) * 1.0001, x))
    x = jnp.ones((256,))
    f(x, 10).block_until_ready()
    say("ready")
    t0 = time.perf_counter()
    f(x, 200_000_000).block_until_ready()          # ~80 s on a 2-core VM
    say(f"ran in {time.perf_counter() - t0:.1f} s")
  """)
  rc, dt = proc.interrupt(0.2)
  assert_interrupted(proc, rc, dt, "script.py")
  assert "ran in" not in proc.stderr()
