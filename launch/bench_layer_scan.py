"""`python -m launch.bench_layer_scan`: layers as one scan over stacked weights (the `_at`
kernels) against the same layers unrolled. The program (its flags, its --help) is
benchmarks.layer_scan."""
from benchmarks import layer_scan
from moejax.cli import app

if __name__ == "__main__":
  app.run(layer_scan.main)
