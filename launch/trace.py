"""`python -m launch.trace` from a checkout; the program is moejax.cli.trace, which an
installed moejax runs as `moejax-trace`."""
import sys

from moejax.cli import trace as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import trace` is moejax.cli.trace itself
