"""`python -m launch.demo` from a checkout; the program is moejax.cli.demo, which an
installed moejax runs as `moejax-demo`."""
from moejax.cli import demo

if __name__ == "__main__":
  demo.entry()
