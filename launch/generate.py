"""`python -m launch.generate` from a checkout; the program is moejax.cli.generate, which an
installed moejax runs as `moejax-generate`."""
import sys

from moejax.cli import generate as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import generate` is moejax.cli.generate itself
