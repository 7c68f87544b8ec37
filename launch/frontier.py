"""`python -m launch.frontier` from a checkout; the program is moejax.cli.frontier, which an
installed moejax runs as `moejax-frontier`."""
import sys

from moejax.cli import frontier as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import frontier` is moejax.cli.frontier itself
