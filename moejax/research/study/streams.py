"""Deterministic evaluation streams: held-out stdlib files and HumanEval, concatenated.

Documents (each followed by EOT, as in training) are shuffled with a seed and
dealt to B streams, each stream taking the next document while it is the
shortest.  The expert cache persists across the documents of a stream, so
topic shifts happen inside a stream.  Attention context: fixed windows of
`window` tokens over the stream, the same for every stream (position t % window;
a window may span a document boundary, as the demo model's training windows
do).  A target is scored when it is the next token of the same document (the
first token of a document, predicted from the previous document's EOT, is not).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np

from moejax.train import data


@dataclasses.dataclass
class Streams:
  tokens: np.ndarray      # [B, T] int32 inputs
  targets: np.ndarray     # [B, T] int32 next tokens
  scored: np.ndarray      # [B, T] bool: target is the next token of the same document
  real: np.ndarray        # [B, T] bool: the input is a real token (not end padding)
  doc: np.ndarray         # [B, T] int32 document of the input token (-1: padding)
  offset: np.ndarray      # [B, T] int32 tokens since the document's start
  pos: np.ndarray         # [T] int32 attention position (t % window)
  doc_source: list        # per document: "stdlib" or "humaneval"
  doc_name: list

  @property
  def num_docs(self) -> int:
    return len(self.doc_source)


def documents(tok, humaneval: bool = True, stdlib: bool = True) -> list[tuple[str, str, list]]:
  """(source, name, token ids + EOT) of the held-out stdlib files and HumanEval problems."""
  eot = tok.token_id(data.EOT)
  out = []
  if stdlib:
    root, files = data.stdlib_files(sysconfig.get_paths()["stdlib"])
    for r in files:
      if data.is_heldout(r):
        out.append(("stdlib", r, tok.encode(data.read_text(os.path.join(root, r))) + [eot]))
  if humaneval:
    for i, t in enumerate(data.humaneval_texts()):
      out.append(("humaneval", f"HumanEval/{i}", tok.encode(t) + [eot]))
  return out


CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.txt")
DOC_MARK = "### doc: "


def calibration_texts(path: str = CALIBRATION) -> list[tuple[str, str]]:
  """(name, text) of each document of the calibration file that ships with moejax (Python
  modules and English prose, written for it; a line `### doc: NAME` starts each)."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith(DOC_MARK):
        out.append((line[len(DOC_MARK):].strip(), []))
      elif out:
        out[-1][1].append(line)
  return [(name, "".join(lines)) for name, lines in out]


def calibration_documents(tok, path: str = CALIBRATION) -> list[tuple[str, str, list]]:
  """(source, name, token ids + EOT where the tokenizer has one) of the shipped
  calibration text: what --policy=auto tunes on, whatever the model (no extra needed)."""
  eot = tok.token_id(data.EOT)
  return [("calibration", name, tok.encode(text) + ([eot] if eot is not None else []))
          for name, text in calibration_texts(path)]


def build(docs, num_streams: int, max_tokens: int, window: int, seed: int = 0,
          max_doc_tokens: int = 0, round_to: int = 1) -> Streams:
  """B streams of equal length T <= max_tokens / B (documents cut at max_doc_tokens,
  their EOT kept; 0: uncut); T - 1 a multiple of round_to when T > round_to."""
  if num_streams < 1:
    raise ValueError(f"--streams must be >= 1, got {num_streams}")
  if window < 2:
    raise ValueError(f"--window must be >= 2, got {window}")
  docs = [(s, n, (ids[:max_doc_tokens - 1] + ids[-1:]) if max_doc_tokens and
           len(ids) > max_doc_tokens else ids) for s, n, ids in docs]
  docs = [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]
  per = max_tokens // num_streams if max_tokens else sum(len(d[2]) for d in docs)
  if per < 2:
    raise ValueError(f"--max_tokens={max_tokens} gives {per} tokens per stream; need >= 2 "
                     f"for {num_streams} streams")
  rows = [[] for _ in range(num_streams)]
  size = [0] * num_streams
  used = []
  for src, name, ids in docs:
    b = min(range(num_streams), key=lambda i: size[i])
    if size[b] >= per:
      break
    rows[b].append((len(used), ids))
    size[b] += len(ids)
    used.append((src, name))
  t = min(per, max(size))
  if t > round_to + 1:
    t = 1 + (t - 1) // round_to * round_to
  if t < 2:
    raise ValueError("the streams are empty: no documents (check --sets)")
  shp = (num_streams, t)
  tokens, targets = np.zeros(shp, np.int32), np.zeros(shp, np.int32)
  scored, real = np.zeros(shp, bool), np.zeros(shp, bool)
  doc, offset = np.full(shp, -1, np.int32), np.zeros(shp, np.int32)
  for b, r in enumerate(rows):
    at = 0
    for d, ids in r:
      n = min(len(ids), t - at)
      if n <= 0:
        break
      tokens[b, at:at + n] = ids[:n]
      doc[b, at:at + n] = d
      offset[b, at:at + n] = np.arange(n)
      real[b, at:at + n] = True
      targets[b, at:at + n - 1] = ids[1:n]
      scored[b, at:at + n - 1] = True
      at += n
  return Streams(tokens, targets, scored, real, doc, offset,
                 (np.arange(t) % window).astype(np.int32),
                 [s for s, _ in used], [n for _, n in used])
