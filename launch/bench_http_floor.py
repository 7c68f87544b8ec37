"""`python -m launch.bench_http_floor`: the floor of an HTTP round trip on this machine.
The program (its flags, its --help) is benchmarks.http_floor."""
from benchmarks import http_floor
from moejax.cli import app

if __name__ == "__main__":
  app.run(http_floor.main)
