"""`python -m launch.generate` from a checkout; the program is moejax.cli.generate, which an
installed moejax runs as `moejax-generate`."""
from moejax.cli import generate

if __name__ == "__main__":
  generate.entry()
