"""bench_scale's model files on disk (benchmarks/scale.py): what is still to be written
and whether the disk holds it, which files a contender reads, and how much of them the
page cache still holds after the drop.

`Files` names one run's files and formats; every function reads only its arguments and
the disk.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

RESERVE = 8 * 10**9          # disk left free at all times


@dataclasses.dataclass(frozen=True)
class Files:
  """One bench_scale run's model files and how they are read."""
  model_dir: str             # the bf16 safetensors folder (benchmarks.models.wide_dir)
  gguf: str                  # the GGUF in `weights`' format
  weights: str               # bf16, q8_0 or q4_0 (--weights)
  layout: str                # fused or per_expert (--layout)
  gguf_dir: str              # where the GGUFs are written (--gguf_dir)


def repacked(model_dir: str) -> bool:
  """Whether moejax's stacked copy of a per-expert checkpoint is already cached."""
  import jax.numpy as jnp
  from moejax.io import repack
  return (os.path.isdir(model_dir) and
          os.path.exists(repack.stacked_path(model_dir, jnp.bfloat16)))


def needs_safetensors(f: Files) -> bool:
  """Whether the bf16 safetensors are still to be written: moejax's bf16 runs read them, and
  a block format's GGUF is made from them; once that GGUF exists they may be gone."""
  if os.path.exists(os.path.join(f.model_dir, "model.safetensors.index.json")):
    return False
  return f.weights == "bf16" or not os.path.exists(f.gguf)


def to_write(f: Files, layers: int, plan: dict, llama: bool) -> dict:
  """{what: bytes} still to be written before the run (llama: llama.cpp contends, so the
  bf16 GGUF is needed even for bf16 weights)."""
  from benchmarks import models as bench_models
  size = bench_models.wide_bytes(layers)
  parts = {}
  if needs_safetensors(f):
    parts["model"] = size
  if f.weights == "bf16" and f.layout == "per_expert" and not repacked(f.model_dir):
    parts["moejax repack"] = plan["all_experts_bytes"]
  bf16_gguf = bench_models.wide_gguf_path(layers, "bf16", os.path.dirname(f.model_dir),
                                          f.layout, f.gguf_dir)
  if (f.weights != "bf16" or llama) and not os.path.exists(bf16_gguf):
    parts["GGUF"] = int(size * 1.01)
  if f.weights != "bf16" and not os.path.exists(f.gguf):
    parts[f"{f.weights} GGUF"] = int(bench_models.wide_bytes(layers, f.weights) * 1.01)
  return parts


def disk_shortfall(f: Files, layers: int, plan: dict, llama: bool) -> str | None:
  """None when the disk holds what is still to be written plus the reserve, else why not."""
  parts = to_write(f, layers, plan, llama)
  need = sum(parts.values()) + RESERVE
  probe = os.path.dirname(os.path.normpath(f.model_dir))
  while not os.path.isdir(probe):
    probe = os.path.dirname(probe)
  free = shutil.disk_usage(probe).free
  if free >= need:
    return None
  what = ", ".join(f"{k} {v}" for k, v in parts.items())
  return (f"needs {need} bytes free on the disk of {probe} ({what}, reserve {RESERVE}); "
          f"it has {free}")


def model_files(name: str, f: Files) -> list[str]:
  """The files contender `name` reads: the GGUF (llama.cpp, or a block format), else the
  safetensors and moejax's repacked copy of them."""
  if name == "llama.cpp" or f.weights != "bf16":
    return [f.gguf]
  files = [os.path.join(f.model_dir, n) for n in os.listdir(f.model_dir)
           if n.endswith(".safetensors")]
  if f.layout == "per_expert" and repacked(f.model_dir):
    import jax.numpy as jnp
    from moejax.io import repack
    files.append(repack.stacked_path(f.model_dir, jnp.bfloat16))
  return files


def cached_bytes(files: list[str]) -> int | None:
  """Bytes of `files` in the page cache (util-linux fincore; None without it): after the
  drop this should be ~0, else another process holds or reads the same files."""
  if not shutil.which("fincore"):
    return None
  res = subprocess.run(["fincore", "--bytes", "--noheadings", "--output=RES", *files],
                       capture_output=True, text=True)
  return sum(int(x) for x in res.stdout.split()) if res.returncode == 0 else None
