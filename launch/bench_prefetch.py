"""`python -m launch.bench_prefetch`: speculative expert prefetch, every mode side by side.
The program (its flags, its --help) is benchmarks.prefetch."""
from benchmarks import prefetch
from moejax.cli import app

if __name__ == "__main__":
  app.run(prefetch.main)
