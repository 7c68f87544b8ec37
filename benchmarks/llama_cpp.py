"""llama.cpp as a peer for bench_peers: build, GGUF conversion, greedy text, timing.

llama.cpp comes from the llama-cpp-python source distribution (its vendored copy),
fetched with pip and built with cmake into a cache directory outside the repository
(first run only): libllama and `llama-simple` (greedy text), plus `llama_timer.cpp`
(next to this file) compiled against libllama, which times prefill and greedy decode
through the C API (llama-bench needs the much larger common library: an hour more of
building on a busy 2-core machine). The converter is the vendored ``convert_hf_to_gguf.py``; it refuses
BPE tokenizers whose pre-tokenizer it does not know by hash, which includes the demo
model's: a byte-level BPE with the GPT-2 split regex (``ByteLevel(use_regex=True)``), so
``convert`` maps an unknown pre-tokenizer to llama.cpp's ``gpt-2`` (the same regex) and
says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

VERSION = "0.3.36"
TARGETS = ("llama-simple",)
TIMER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_timer.cpp")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "llama.cpp")

# Run by `convert` in a subprocess: the vendored converter, with an unknown BPE
# pre-tokenizer mapped to gpt-2 instead of refused.
_CONVERT = r"""
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
from conversion import base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
  try:
    return _orig(self, tokenizer)
  except NotImplementedError:
    print("[bench_peers] pre-tokenizer not in the converter's list: mapped to 'gpt-2' "
          "(byte-level BPE with the GPT-2 split regex)", file=sys.stderr)
    return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


class Unavailable(RuntimeError):
  """llama.cpp cannot be built here (the message says why and what to install)."""


def _run(cmd: list[str], log: str, what: str, **kw):
  with open(log, "a") as f:
    f.write(f"\n$ {' '.join(cmd)}\n")
    f.flush()
    res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
  if res.returncode != 0:
    with open(log) as f:
      tail = f.read()[-3000:]
    raise Unavailable(f"{what} failed (exit {res.returncode}); end of {log}:\n{tail}")


def source_dir(cache: str) -> str:
  return os.path.join(cache, f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp")


def binaries(cache: str) -> dict[str, str]:
  bins = {t: os.path.join(cache, "build", "bin", t) for t in TARGETS}
  bins["llama_timer"] = os.path.join(cache, "build", "bin", "llama_timer")
  return bins


def build(cache: str = DEFAULT_CACHE) -> dict[str, str]:
  """Paths of the llama.cpp tools, built on the first call (long: ~30-60 min on 2 cores)."""
  bins = binaries(cache)
  timer = bins["llama_timer"]
  if (all(os.path.exists(p) for p in bins.values())
      and os.path.getmtime(timer) >= os.path.getmtime(TIMER_SRC)):
    return bins
  if all(os.path.exists(bins[t]) for t in TARGETS):  # llama.cpp built: only the timer
    _build_timer(cache, bins["llama_timer"], os.path.join(cache, "build.log"))
    return bins
  if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
    raise Unavailable("no C++ compiler (install g++ or clang, or set CXX) to build llama.cpp")
  os.makedirs(cache, exist_ok=True)
  log = os.path.join(cache, "build.log")
  cmake = _configure(cache, log, "bench_peers", "llama.cpp")
  _run([cmake, "--build", os.path.join(cache, "build"), "-j", str(os.cpu_count() or 2),
        "--target", *TARGETS], log, "cmake build")
  _build_timer(cache, bins["llama_timer"], log)
  return bins


def _configure(cache: str, log: str, who: str, what: str) -> str:
  """The llama-cpp-python source (pip download, once) configured with cmake into
  cache/build (Release, native, no tests or server) -> the cmake executable."""
  src = source_dir(cache)
  if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
    sdist = os.path.join(cache, f"llama_cpp_python-{VERSION}.tar.gz")
    if not os.path.exists(sdist):
      print(f"[{who}] fetching llama-cpp-python=={VERSION} (source) with pip", file=sys.stderr)
      _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}",
            "--no-deps", "--no-binary", ":all:", "-d", cache], log, "pip download")
    with tarfile.open(sdist) as tf:
      tf.extractall(cache, filter="data")
  cmake = shutil.which("cmake")
  if cmake is None:
    print(f"[{who}] no cmake: installing it into this environment with pip", file=sys.stderr)
    _run([sys.executable, "-m", "pip", "install", "cmake"], log, "pip install cmake")
    cmake = os.path.join(os.path.dirname(sys.executable), "cmake")
  gen = ["-G", "Ninja"] if shutil.which("ninja") else []
  print(f"[{who}] building {what} into {cache}/build (first run only; log {log})",
        file=sys.stderr)
  _run([cmake, "-S", src, "-B", os.path.join(cache, "build"), *gen, "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
        "-DGGML_NATIVE=ON"], log, "cmake configure")
  return cmake


def _build_timer(cache: str, out: str, log: str):
  src, lib = source_dir(cache), os.path.join(cache, "build", "bin")
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  _run([cxx, "-O2", "-std=c++17", TIMER_SRC, "-o", out, "-I", os.path.join(src, "include"),
        "-I", os.path.join(src, "ggml", "include"), "-L", lib, "-lllama", "-lggml",
        "-lggml-base", f"-Wl,-rpath,{lib}"], log, "compiling llama_timer.cpp")


EXPERT_TIMER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "ggml_expert_timer.cpp")


def build_ggml(cache: str = DEFAULT_CACHE) -> str:
  """The path of `ggml_expert_timer` (benchmarks/ggml_expert_timer.cpp) linked against the
  ggml libraries of this llama.cpp build: only the `ggml` target is built (minutes, not
  the whole of llama.cpp; same configuration as `build`, same build folder), and the timer
  is recompiled when its source is newer than the binary."""
  out = os.path.join(cache, "build", "bin", "ggml_expert_timer")
  if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(EXPERT_TIMER_SRC):
    return out
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not cxx:
    raise Unavailable("no C++ compiler (install g++ or clang, or set CXX) to build ggml")
  os.makedirs(cache, exist_ok=True)
  log, src, build_dir = os.path.join(cache, "build.log"), source_dir(cache), os.path.join(cache, "build")
  lib = os.path.join(build_dir, "bin")
  if not os.path.exists(os.path.join(lib, "libggml-cpu.so")):
    cmake = _configure(cache, log, "bench_host", "ggml")
    _run([cmake, "--build", build_dir, "-j", str(os.cpu_count() or 2), "--target", "ggml"],
         log, "cmake build (ggml)")
  _run([cxx, "-O2", "-std=c++17", EXPERT_TIMER_SRC, "-o", out, "-I",
        os.path.join(src, "ggml", "include"), "-L", lib, "-lggml", "-lggml-base",
        "-lggml-cpu", f"-Wl,-rpath,{lib}"], log, "compiling ggml_expert_timer.cpp")
  return out


def time_experts(timer: str, d: int, inter: int, experts: int, k: int, threads: int,
                 iters: int) -> dict:
  """One ggml_expert_timer run: {"median_s", "min_s", "mean_s", ...} per call."""
  cmd = [timer, *(str(v) for v in (d, inter, experts, k, threads, iters))]
  res = subprocess.run(cmd, capture_output=True, text=True)
  if res.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr[-2000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])


def convert(cache: str, hf_dir: str, outtype: str, out_dir: str) -> str:
  """`hf_dir` as GGUF (`outtype` f32 or bf16) under `out_dir`; converted once."""
  out = os.path.join(out_dir, f"{os.path.basename(os.path.normpath(hf_dir))}-{outtype}.gguf")
  if os.path.exists(out):
    return out
  os.makedirs(out_dir, exist_ok=True)
  log = os.path.join(out_dir, "convert.log")
  _run([sys.executable, "-c", _CONVERT, source_dir(cache), hf_dir, "--outfile", out + ".tmp",
        "--outtype", outtype], log, f"GGUF conversion of {hf_dir}")
  os.replace(out + ".tmp", out)
  return out


def greedy_text(bins: dict, gguf: str, prompt: str, n: int) -> str:
  """llama-simple's greedy continuation of `prompt` (the continuation only)."""
  res = subprocess.run([bins["llama-simple"], "-m", gguf, "-n", str(n), prompt],
                       capture_output=True, text=True)
  if res.returncode != 0:
    raise RuntimeError(f"llama-simple failed: {res.stderr[-2000:]}")
  out = res.stdout
  return out[len(prompt):] if out.startswith(prompt) else out


def time_run(bins: dict, gguf: str, threads: int, prefill: int, prompt: int,
             decode: int, tokens_file: str | None = None) -> dict:
  """One llama_timer run: {"prefill_tok_s", "decode_tok_s", ...} (see llama_timer.cpp);
  with `tokens_file` (benchmarks.stream.write_ids) every token is read from it and decode
  is teacher-forced."""
  cmd = [bins["llama_timer"], gguf, str(threads), str(prefill), str(prompt), str(decode)]
  cmd += [tokens_file] if tokens_file else []
  res = subprocess.run(cmd, capture_output=True, text=True)
  if res.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr[-2000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])
