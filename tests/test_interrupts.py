"""Ctrl-C at any moment of start-up ends a program cleanly (moejax/interrupts.py).

The fault: SIGINT 0.3 s after `python -m launch.generate` started crashed it in ~1% of
tries while `from jaxlib import _jax` ran (SIGSEGV, or SIGABRT "terminate called after
throwing an instance of 'nanobind::python_error'").  tests/interrupt_tries.py runs the
200-try version."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from moejax import interrupts
from tests import interrupt_tries

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ctrl_c_during_start_up_never_crashes():
  codes, bad = interrupt_tries.tries(12, 0.2, 1.0, seed=46)
  for delay, code, err in bad:
    assert code not in interrupt_tries.CRASHES, (delay, code, err)
    # only Python's own start-up (site, runpy), before any line of moejax ran, may end
    # by the signal or with a traceback: no package can run earlier
    assert "/moejax/" not in err and "/launch/" not in err, (delay, code, err)
  assert codes[130] >= 6, codes


def run(body: str) -> subprocess.CompletedProcess:
  code = "import os, signal, sys, threading, time\nfrom moejax import interrupts\n"
  return subprocess.run([sys.executable, "-c", code + textwrap.dedent(body)], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                        timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))


@pytest.mark.parametrize("other_thread", [False, True])
def test_a_held_interrupt_is_raised_after_the_block(other_thread):
  # with another thread alive the kernel may hand it the signal; Python then runs the
  # handler in the main thread at its next bytecode: the hold's own handler only notes it
  r = run(f"""
  if {other_thread}:
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
  try:
    with interrupts.held_sigint():
      os.kill(os.getpid(), signal.SIGINT)
      t = time.perf_counter()
      while time.perf_counter() - t < 0.2:     # bytecode: where Python would raise it
        pass
      print("block finished", flush=True)
    print("not raised", flush=True)
  except KeyboardInterrupt:
    print("raised after the block", flush=True)
  # and the handler is Python's again
  try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
  except KeyboardInterrupt:
    print("raised again", flush=True)
  """)
  assert r.stdout.split("\n")[:3] == ["block finished", "raised after the block",
                                      "raised again"], (r.stdout, r.stderr)


def test_extension_modules_are_loaded_held_and_keep_their_loader():
  r = run("""
  import importlib.machinery as m
  assert any(type(f).__name__ == "_HoldingFinder" for f in sys.meta_path)
  import _lzma, jax
  for mod in (_lzma, jax, sys.modules["jaxlib._jax"]):
    assert type(mod.__loader__).__name__ != "_HeldLoader", mod
    assert mod.__spec__.loader is mod.__loader__, mod
  assert isinstance(_lzma.__loader__, m.ExtensionFileLoader)
  print("ok")
  """)
  assert r.stdout == "ok\n", r.stderr


@pytest.mark.parametrize("argv,orig,want", [
    (["/venv/bin/moejax-generate"], ["python", "/venv/bin/moejax-generate"], "moejax-generate"),
    (["x"], ["python", "-m", "launch.generate", "--policy=quality"],
     "python -m launch.generate"),
    (["x"], ["python", "-m", "pytest", "tests"], None),
    (["script.py"], ["python", "script.py"], None),
])
def test_program_name(monkeypatch, argv, orig, want):
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.setattr(sys, "orig_argv", orig)
  assert interrupts.program_name() == want
