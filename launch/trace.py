"""`python -m launch.trace` from a checkout; the program is moejax.cli.trace, which an
installed moejax runs as `moejax-trace`."""
from moejax.cli import trace

if __name__ == "__main__":
  trace.entry()
