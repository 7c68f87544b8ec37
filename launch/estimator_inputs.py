"""`python -m launch.estimator_inputs`: which inputs help the next-layer estimator.
The program (its flags, its --help) is benchmarks.estimator_inputs."""
from benchmarks import estimator_inputs
from moejax.cli import app

if __name__ == "__main__":
  app.run(estimator_inputs.main)
