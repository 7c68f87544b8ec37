"""`python -m launch.predictors`: how well layer l predicts layer l+1's experts.
The program (its flags, its --help) is benchmarks.predictors."""
from benchmarks import predictors
from moejax.cli import app

if __name__ == "__main__":
  app.run(predictors.main)
