"""`python -m launch.bench_host`: a HOST miss's expert compute, moejax's beside llama.cpp's.
The program (its flags, its --help) is benchmarks.host."""
from benchmarks import host
from moejax.cli import app

if __name__ == "__main__":
  app.run(host.main)
