"""`python -m launch.default_vectors` from a checkout; the program is
moejax.cli.prepare.default_vectors, which an installed moejax runs as `moejax-default-vectors`."""
from moejax.cli.prepare import default_vectors

if __name__ == "__main__":
  default_vectors.entry()
