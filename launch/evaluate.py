"""`python -m launch.evaluate`: held-out perplexity per domain, expert load, routing locality.
The program (its flags, its --help) is benchmarks.evaluate."""
from benchmarks import evaluate
from moejax.cli import app

if __name__ == "__main__":
  app.run(evaluate.main)
