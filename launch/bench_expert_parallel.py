"""`python -m launch.bench_expert_parallel`: expert parallelism's hit rate and time per
token against the device count.  The program (its flags, its --help) is
benchmarks.expert_parallel."""
from benchmarks import expert_parallel
from moejax.cli import app

if __name__ == "__main__":
  app.run(expert_parallel.main)
