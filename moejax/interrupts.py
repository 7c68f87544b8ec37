"""Ctrl-C during start-up: held while C extensions initialise, one line and exit 130.

The fault: SIGINT ~0.3 s after `python -m launch.generate` started crashed the process in
~1% of tries (SIGSEGV with a fatal-error dump, or SIGABRT "terminate called after
throwing an instance of 'nanobind::python_error'") while `from jaxlib import _jax` ran.
Python turns SIGINT into KeyboardInterrupt at the next bytecode of the main thread, and
that may be Python code a C extension's initialisation is calling back into (jaxlib's
nanobind modules), which cannot unwind it.

`install()` (run first thing by `import moejax`) puts a finder at the head of
`sys.meta_path`: while a C extension module, or the `jax` and `jaxlib` packages as a
whole, are imported in the main thread, SIGINT is *held*: blocked in that thread
(`pthread_sigmask`), and Python's handler replaced by one that only notes the signal
(it may still reach another thread).  Afterwards the handler and the mask are restored
and a held signal is delivered at once, as KeyboardInterrupt raised from the import
statement: a Python point where the extension is fully set up.

In a moejax program (a `moejax-*` console script, or `python -m launch.X` /
`python -m moejax.X`), a KeyboardInterrupt that reaches the top before
`moejax.cli.app.run` takes over (the imports of start-up) ends the process with
"<program>: interrupted" and exit 130, no traceback, and without the interpreter's
finalisation (a half-imported jaxlib may crash in it).
"""

from __future__ import annotations

# Light imports only (site has loaded contextlib and importlib.machinery): this runs in
# the start-up window it guards; importlib.abc alone took 50 ms.

import contextlib
import importlib.machinery
import os
import signal
import sys
import threading

HELD_PACKAGES = ("jax", "jaxlib")   # imported whole with SIGINT held
EXIT_INTERRUPT = 130                # 128 + SIGINT, the shell's convention

_depth = 0                          # nested holds (main thread only)
_hooked = False                     # the one-line exit installed


@contextlib.contextmanager
def held_sigint():
  """SIGINT arriving in the block is delivered when it ends (main thread; elsewhere, and
  inside another hold, a no-op)."""
  global _depth
  if _depth or threading.current_thread() is not threading.main_thread():
    yield
    return
  noted = []
  mask = hasattr(signal, "pthread_sigmask")
  old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set()) if mask else None   # as it is
  handler = signal.getsignal(signal.SIGINT)
  swap = callable(handler)          # not SIG_IGN / SIG_DFL: those are not Python code
  _depth += 1
  try:
    if mask:
      signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if swap:
      signal.signal(signal.SIGINT, lambda *_: noted.append(True))
    yield
  finally:
    _depth -= 1
    try:
      if swap:
        signal.signal(signal.SIGINT, handler)
    finally:
      if mask:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)   # a pending SIGINT: raised here
    if noted:
      signal.raise_signal(signal.SIGINT)                        # ... or here


class _HeldLoader:
  """`loader` with create_module and exec_module under `held_sigint`; once the module is
  set up its __loader__ and __spec__.loader are `loader` again."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    with held_sigint():
      return self._loader.create_module(spec)

  def exec_module(self, module):
    try:
      with held_sigint():
        self._loader.exec_module(module)
    finally:
      module.__loader__ = self._loader
      if getattr(module, "__spec__", None) is not None:
        module.__spec__.loader = self._loader

  def __getattr__(self, name):
    return getattr(self._loader, name)


class _HoldingFinder:
  """Finds a module as the finders after it would, and holds SIGINT over its loading
  when it is a C extension or one of HELD_PACKAGES."""

  def find_spec(self, name, path=None, target=None):
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(name, path, target)
      if spec is not None:
        break
    else:
      return None
    if spec.loader is not None and (name in HELD_PACKAGES or isinstance(
        spec.loader, importlib.machinery.ExtensionFileLoader)):
      spec.loader = _HeldLoader(spec.loader)
    return spec


def program_name() -> str | None:
  """The moejax program this process runs, as cli.app.prog() names it, or None."""
  argv = getattr(sys, "orig_argv", [])
  if "-m" in argv[:-1]:
    module = argv[argv.index("-m") + 1]
    return f"python -m {module}" if module.startswith(("launch.", "moejax.")) else None
  script = os.path.basename(sys.argv[0]) if sys.argv else ""
  return script if script.startswith("moejax-") else None


def _exit_on_interrupt(hook, prog: str):
  def excepthook(exc_type, exc, tb):
    if not issubclass(exc_type, KeyboardInterrupt):
      return hook(exc_type, exc, tb)
    try:
      sys.stdout.flush()
      sys.stderr.write(f"{prog}: interrupted\n")
      sys.stderr.flush()
    finally:
      os._exit(EXIT_INTERRUPT)
  return excepthook


def install():
  """The holding finder (once), and in a moejax program the one-line exit 130."""
  global _hooked
  if not any(isinstance(f, _HoldingFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _HoldingFinder())
  prog = program_name()
  if prog is not None and not _hooked:
    sys.excepthook = _exit_on_interrupt(sys.excepthook, prog)
    _hooked = True
