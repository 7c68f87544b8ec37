"""`python -m launch.train_demo`: trains the demo model (resumable orbax checkpoints) and
exports it in Hugging Face format.  The program (its flags, its --help) is
benchmarks.train_demo."""
from benchmarks import train_demo
from moejax.cli import app

if __name__ == "__main__":
  app.run(train_demo.main)
