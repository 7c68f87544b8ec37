"""`python -m launch.bench_memory`: each run's peak anonymous RSS against its memory plan.
The program (its flags, its --help) is benchmarks.memory."""
from benchmarks import memory
from moejax.cli import app

if __name__ == "__main__":
  app.run(memory.main)
