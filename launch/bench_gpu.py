"""`python -m launch.bench_gpu --presets_only`: the prepared GPU check (docs/gpu.md).
The program (its flags, its --help) is benchmarks.gpu_check."""
from benchmarks import gpu_check
from moejax.cli import app

if __name__ == "__main__":
  app.run(gpu_check.main)
