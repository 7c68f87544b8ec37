"""`python -m launch.bench_simulator`: the replay simulator's decisions per second.
The program (its flags, its --help) is benchmarks.simulator."""
from benchmarks import simulator
from moejax.cli import app

if __name__ == "__main__":
  app.run(simulator.main)
