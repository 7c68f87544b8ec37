"""`python -m launch.train_estimators` from a checkout; the program is
moejax.cli.prepare.train_estimators, which an installed moejax runs as
`moejax-train-estimators`."""
import sys

from moejax.cli.prepare import train_estimators as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import train_estimators`: the program itself
