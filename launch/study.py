"""`python -m launch.study` from a checkout; the program is moejax.cli.study, which an
installed moejax runs as `moejax-study`."""
from moejax.cli import study

if __name__ == "__main__":
  study.entry()
