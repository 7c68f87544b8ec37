"""`python -m launch.bench_serve`: time to first token and decode tok/s through the server.
The program (its flags, its --help) is benchmarks.serve."""
from benchmarks import serve
from moejax.cli import app

if __name__ == "__main__":
  app.run(serve.main)
