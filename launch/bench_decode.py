"""`python -m launch.bench_decode`: decode/prefill throughput, all experts resident.
The program (its flags, its --help) is benchmarks.decode."""
from benchmarks import decode
from moejax.cli import app

if __name__ == "__main__":
  app.run(decode.main)
