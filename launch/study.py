"""`python -m launch.study` from a checkout; the program is moejax.cli.study, which an
installed moejax runs as `moejax-study`."""
import sys

from moejax.cli import study as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import study` is moejax.cli.study itself
