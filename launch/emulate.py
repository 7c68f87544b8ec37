"""`python -m launch.emulate` from a checkout; the program is moejax.cli.emulate, which an
installed moejax runs as `moejax-emulate`."""
from moejax.cli import emulate

if __name__ == "__main__":
  emulate.entry()
