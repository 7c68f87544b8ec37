"""`python -m launch.simulate` from a checkout; the program is moejax.cli.simulate, which an
installed moejax runs as `moejax-simulate`."""
from moejax.cli import simulate

if __name__ == "__main__":
  simulate.entry()
