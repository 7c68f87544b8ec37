"""`python -m launch.align_gguf` from a checkout; the program is
moejax.cli.prepare.align_gguf, which an installed moejax runs as `moejax-align-gguf`."""
from moejax.cli.prepare import align_gguf

if __name__ == "__main__":
  align_gguf.entry()
