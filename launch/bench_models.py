"""For launch/bench_expert_parallel.py, which imports the benchmark models from here: they
live in benchmarks.models, which new code imports."""
from benchmarks.models import load  # noqa: F401
