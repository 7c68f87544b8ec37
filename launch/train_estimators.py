"""`python -m launch.train_estimators` from a checkout; the program is
moejax.cli.prepare.train_estimators, which an installed moejax runs as
`moejax-train-estimators`."""
from moejax.cli.prepare import train_estimators

if __name__ == "__main__":
  train_estimators.entry()
