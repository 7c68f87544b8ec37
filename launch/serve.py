"""`python -m launch.serve` from a checkout; the program is moejax.serve.main, which an
installed moejax runs as `moejax-serve`."""
from moejax.serve import main

if __name__ == "__main__":
  main.entry()
