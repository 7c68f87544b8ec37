"""`python -m launch.bench_scale`: moejax against llama.cpp on a model larger than its memory limit.
The program (its flags, its --help) is benchmarks.scale."""
from benchmarks import scale
from moejax.cli import app

if __name__ == "__main__":
  app.run(scale.main)
