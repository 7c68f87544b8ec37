"""`python -m launch.demo` from a checkout; the program is moejax.cli.demo, which an
installed moejax runs as `moejax-demo`."""
import sys

from moejax.cli import demo as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import demo` is moejax.cli.demo itself
