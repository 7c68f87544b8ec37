"""`python -m launch.bench_compile_depth`: the engine's decode-step compile time against
depth, layers scanned or unrolled. The program (its flags, its --help) is
benchmarks.compile_depth."""
from benchmarks import compile_depth
from moejax.cli import app

if __name__ == "__main__":
  app.run(compile_depth.main)
