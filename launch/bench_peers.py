"""`python -m launch.bench_peers`: moejax beside llama.cpp and transformers on CPU.
The program (its flags, its --help) is benchmarks.peers."""
from benchmarks import peers
from moejax.cli import app

if __name__ == "__main__":
  app.run(peers.main)
