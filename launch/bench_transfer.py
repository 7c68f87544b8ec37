"""`python -m launch.bench_transfer`: one expert's copy as the engine makes it, host store to slot.
The program (its flags, its --help) is benchmarks.transfer."""
from benchmarks import transfer
from moejax.cli import app

if __name__ == "__main__":
  transfer.define_flags()
  app.run(transfer.main)
