"""`python -m launch.serve` from a checkout; the program is moejax.serve.main, which an
installed moejax runs as `moejax-serve`."""
import sys

from moejax.serve import main as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import serve` is moejax.serve.main itself
