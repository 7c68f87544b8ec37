"""`python -m launch.frontier` from a checkout; the program is moejax.cli.frontier, which an
installed moejax runs as `moejax-frontier`."""
from moejax.cli import frontier

if __name__ == "__main__":
  frontier.entry()
