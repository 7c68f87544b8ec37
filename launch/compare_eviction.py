"""`python -m launch.compare_eviction`: eviction rules replayed over router traces.
The program (its flags, its --help) is benchmarks.compare_eviction."""
from benchmarks import compare_eviction
from moejax.cli import app

if __name__ == "__main__":
  app.run(compare_eviction.main)
