"""The disk tier's layout: the MoE layers' experts stacked [L, E, ...] in one mapped file.

The engine copies an expert with one dynamic slice of a stacked ``[E, ...]`` array,
and on the CPU backend jax hands a mapped array to a program without a copy only when
it starts on a 64-byte boundary.  Published checkpoints store one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``), and a fused checkpoint's tensors sit wherever
the header put them.  So for ``--store=mmap`` the routed experts are written once into
a stacked, page-aligned file, and every later run maps it:

  path = stacked_file(model_dir, layers, num_experts, kinds, dtype, chunks)
  f = SafetensorsFile(path)          # f.get("layers.3.gate_up") -> a read-only memmap

The file lives in ``$MOEJAX_CACHE_DIR/experts`` (default ``~/.cache/moejax/experts``),
named after the checkpoint folder and a key of its shards' names, sizes and mtimes, the
dtype and this layout's version: a changed checkpoint gets a new file.  It holds the
experts in the run's dtype (the checkpoint's own when they agree: no conversion), one
tensor ``experts.{kind}`` [L, E, ...] per kind over the MoE layers in order (the engine's
scan over layers reads layer i of it in place), each on a 4096-byte boundary.  Writing
shows a progress bar, checks the free disk space first, and goes through a ``.part``
file renamed at the end, so an interrupted repack is redone, never half-used.

Per-expert slices were the alternative (no repack; docs/engine.md, "Memory tiers"): the
program would take E arrays per tensor kind and layer (384 arguments a layer at
Qwen3-30B-A3B) and choose among them with a switch per copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import numpy as np

from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, write_streamed

VERSION = 2          # 2: one tensor per kind [L, E, ...] (1: one per layer and kind)
ALIGN = 4096
JAX_ALIGN = 64       # jax's CPU client wraps a host buffer in place only at this alignment


class RepackError(CheckpointError):
  """The stacked expert file cannot be written (e.g. the disk lacks the space)."""


def cache_root() -> str:
  return os.environ.get("MOEJAX_CACHE_DIR",
                        os.path.join(os.path.expanduser("~"), ".cache", "moejax"))


def checkpoint_key(model_dir: str, dtype) -> str:
  """A key that changes when any shard of the checkpoint, the dtype or the layout does."""
  h = hashlib.sha256(f"v{VERSION} {np.dtype(dtype).name}".encode())
  for name in sorted(os.listdir(model_dir)):
    if name.endswith(".safetensors") or name.endswith(".json"):
      st = os.stat(os.path.join(model_dir, name))
      h.update(f"{name} {st.st_size} {st.st_mtime_ns}".encode())
  return h.hexdigest()[:16]


def stacked_path(model_dir: str, dtype) -> str:
  name = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
  return os.path.join(cache_root(), "experts", f"{name}-{checkpoint_key(model_dir, dtype)}",
                      "experts.safetensors")


def checked_stamp(model_dir: str, dtype) -> str:
  """A marker beside where the stacked file would be: the mapped checkpoint's experts were
  checked for NaN/Inf (the key changes with the checkpoint, so a changed one is checked
  again).  A directly mapped checkpoint is read whole once for the check, not every run."""
  return os.path.join(os.path.dirname(stacked_path(model_dir, dtype)), "finite.ok")


def aligned(a: np.ndarray) -> bool:
  """Whether jax's CPU client can wrap `a`'s memory without a copy."""
  return a.__array_interface__["data"][0] % JAX_ALIGN == 0


def check_space(model_dir: str, layers, num_experts: int, kinds: dict, dtype,
                per_expert: bool):
  """Raises RepackError, before anything is read, when a repack would be needed
  (`per_expert`, or a checkpoint in another dtype) and the cache folder's disk cannot
  hold it; the message names the bytes and MOEJAX_CACHE_DIR."""
  path = stacked_path(model_dir, dtype)
  if os.path.exists(path) or not per_expert:
    return
  _check_free(model_dir, path, _specs(layers, num_experts, kinds, dtype))


def _specs(layers, num_experts: int, kinds: dict, dtype) -> list:
  dt = np.dtype(dtype)
  return [(f"experts.{k}", dt, (len(layers), num_experts) + tuple(s)) for k, s in kinds.items()]


def _check_free(model_dir: str, path: str, specs) -> int:
  total = sum(int(np.prod(s)) * np.dtype(dt).itemsize for _, dt, s in specs)
  folder = os.path.dirname(path)
  probe = folder
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  free = shutil.disk_usage(probe).free
  need = total + len(specs) * ALIGN
  if free < need:
    raise RepackError(
        f"{model_dir}: --store=mmap repacks the routed experts into one stacked file of "
        f"{need / 1e9:.2f} GB under {folder}, but that disk has {free / 1e9:.2f} GB free; "
        f"free space or set MOEJAX_CACHE_DIR to a larger disk")
  return total


def stacked_file(model_dir: str, layers, num_experts: int, kinds: dict, dtype, chunks,
                 progress: bool | None = None) -> tuple[str, bool]:
  """(path of the stacked file, whether it was written now).

  layers: the MoE layers; kinds: {kind: per-expert shape}; chunks(layer, kind) -> an
  iterable of arrays in `dtype` whose bytes are that layer's [E, ...] tensor, expert by
  expert.  An existing complete file for the same key is reused."""
  path = stacked_path(model_dir, dtype)
  if os.path.exists(path):
    return path, False
  dt = np.dtype(dtype)
  specs = _specs(layers, num_experts, kinds, dtype)
  total = _check_free(model_dir, path, specs)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  print(f"[moejax] --store=mmap: repacking the routed experts once into {path} "
        f"({total / 1e9:.2f} GB, {dt.name}, one [L, E, ...] tensor per kind; later runs "
        f"map it)",
        file=sys.stderr)
  from tqdm import tqdm
  bar = tqdm(total=total, desc="repacking experts", unit="B", unit_scale=True,
             unit_divisor=1000, file=sys.stderr, leave=False, mininterval=0.25,
             disable=not (sys.stderr.isatty() if progress is None else progress))
  by_layer = lambda k: (c for l in layers for c in chunks(l, k))
  try:
    write_streamed(path, specs, lambda name: by_layer(name[len("experts."):]),
                   {"format": "moejax-experts", "source": os.path.abspath(model_dir),
                    "layout": json.dumps({"version": VERSION, "align": ALIGN})},
                   align=ALIGN, on_bytes=bar.update)
  finally:
    bar.close()
    if os.path.exists(path + ".part"):
      os.remove(path + ".part")
  return path, True


def open_stacked(path: str, layers, kinds) -> dict:
  """{layer: {kind: read-only memmap [E, ...]}} of a stacked file: views of its one
  [L, E, ...] tensor per kind (`store.layer_stacked` hands those to the engine whole)."""
  f = SafetensorsFile(path)
  whole = {k: f.get(f"experts.{k}") for k in kinds}
  return {l: {k: whole[k][j] for k in kinds} for j, l in enumerate(layers)}
