"""For launch/bench_host.py, which imports llama.cpp's helpers from here: they live in
benchmarks.llama_cpp, which new code imports."""
from benchmarks.llama_cpp import DEFAULT_CACHE, Unavailable, build_ggml, time_experts  # noqa: F401
