"""The one token stream the speed benchmarks decode, and the calibration text of the
benchmark models' routers.

Every benchmark that times decoding (bench_peers, bench_offload, bench_scale) decodes the
same fixed held-out text teacher-forced, one token at a time, after the same prompt: the
demo corpus's held-out CPython files (the split `launch.trace --text=held_out` reads),
concatenated in their sorted order with the end-of-text token between documents.  moejax
and llama.cpp then see the same tokens and so read the same experts (llama.cpp's timer
reads the ids from a file, `write_ids`).

The routers of the random benchmark models are calibrated on the train split
(`calibration_ids`), never on this text.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from moejax.io.tokenizer import Tokenizer
from moejax.train import data


@functools.lru_cache(maxsize=4)
def _docs(split: int) -> tuple[str, ...]:
  root, files = data.stdlib_files()
  pick = [r for r in files if data.is_heldout(r) == bool(split)]
  return tuple(os.path.join(root, r) for r in pick)


def _encode_docs(tok: Tokenizer, paths, n: int, stride: int = 1, per_doc: int = 0) -> list[int]:
  eot = tok.token_id(data.EOT)
  ids: list[int] = []
  for p in paths[::stride]:
    doc = tok.encode(data.read_text(p))
    mid = max(0, (len(doc) - per_doc) // 2)
    ids.extend(doc[mid:mid + per_doc] if per_doc else doc)
    if eot is not None:
      ids.append(eot)
    if len(ids) >= n:
      break
  return ids[:n]


def held_out_ids(tokenizer_path: str, n: int) -> list[int]:
  """The first `n` tokens of the held-out text (the benchmarks' stream)."""
  ids = _encode_docs(Tokenizer(tokenizer_path), _docs(1), n)
  if len(ids) < n:
    raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than the {n} asked")
  return ids


def calibration_ids(tokenizer_path: str, n: int = 16384, stride: int = 7,
                    per_doc: int = 512) -> list[int]:
  """`n` tokens of the train split: `per_doc` tokens from the middle of every `stride`-th
  file (a file's head is mostly licence and imports), so that many documents contribute."""
  return _encode_docs(Tokenizer(tokenizer_path), _docs(0), n, stride, per_doc)


def write_ids(path: str, ids) -> str:
  """The ids as text, one per line (what benchmarks/llama_timer.cpp reads)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(str(int(i)) for i in ids) + "\n")
  return path
