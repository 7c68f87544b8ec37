"""`python -m launch.bench_speed`: before/after of the resident decode and prefill paths.
The program (its flags, its --help) is benchmarks.speed."""
from benchmarks import speed
from moejax.cli import app

if __name__ == "__main__":
  app.run(speed.main)
