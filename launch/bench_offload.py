"""`python -m launch.bench_offload`: the offload presets' time per token against the Sampler.
The program (its flags, its --help) is benchmarks.offload."""
from benchmarks import offload
from moejax.cli import app

if __name__ == "__main__":
  app.run(offload.main)
