"""`python -m launch.default_vectors` from a checkout; the program is
moejax.cli.prepare.default_vectors, which an installed moejax runs as `moejax-default-vectors`."""
import sys

from moejax.cli.prepare import default_vectors as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import default_vectors`: the program itself
