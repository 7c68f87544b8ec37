"""`python -m launch.simulate` from a checkout; the program is moejax.cli.simulate, which an
installed moejax runs as `moejax-simulate`."""
import sys

from moejax.cli import simulate as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import simulate` is moejax.cli.simulate itself
