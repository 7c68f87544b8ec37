"""`python -m launch.emulate` from a checkout; the program is moejax.cli.emulate, which an
installed moejax runs as `moejax-emulate`."""
import sys

from moejax.cli import emulate as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import emulate` is moejax.cli.emulate itself
