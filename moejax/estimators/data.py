"""Training pairs for the estimators: (q_l, quasi logits, true logits of layer l+1).

Recorded from teacher-forced runs (moejax.prefetch.speculation.predictions) over windows of
text and written as shards ``shard_00000.npz`` ... with arrays ``q`` [P, N, D],
``quasi`` [P, N, E], ``true`` [P, N, E] (P = consecutive MoE-layer pairs, float16),
plus ``meta.json`` (config hash, windows, tokens).
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np

from moejax.prefetch import estimator
from moejax.train import corpus
from moejax.prefetch import speculation
from moejax.train import data as corpus_data
from moejax.io.tokenizer import Tokenizer


def train_stream(model_dir: str, tokens_file: str = "",
                 domains: tuple[str, ...] = corpus.DOMAINS, progress=None) -> np.ndarray:
  """The training token stream: `tokens_file` (an encoded .npy, e.g. the demo model
  training's <data_dir>/train_tokens.npy: every domain), else the corpus' train split of
  `domains` encoded, domain by domain (through `progress`, an iterable's wrapper such as
  tqdm, when given)."""
  if tokens_file:
    if tuple(domains) != corpus.DOMAINS:
      raise ValueError(f"--tokens_file holds every corpus domain; it cannot be restricted "
                       f"to {','.join(domains)} (drop --tokens_file)")
    return np.load(tokens_file, mmap_mode="r")
  tok = Tokenizer(model_dir)
  each = progress(tuple(domains)) if progress else tuple(domains)
  return np.concatenate([corpus_data.encode_stream(tok._tok, corpus.build(domains=(d,))[0][d][0])
                         for d in each])


def heldout_python(model_dir: str, tokens_file: str = "") -> np.ndarray:
  """The held-out stdlib stream: heldout_python.npy next to `tokens_file`, else encoded."""
  path = os.path.join(os.path.dirname(tokens_file), "heldout_python.npy") if tokens_file else ""
  if path and os.path.exists(path):
    return np.load(path)
  tok = Tokenizer(model_dir)
  return corpus_data.encode_stream(tok._tok, corpus.build(domains=("python",))[0]["python"][1])


def windows(stream: np.ndarray, n: int, seq: int, seed: int = 0,
            shuffle: bool = True) -> np.ndarray:
  """[min(n, available), seq] int32: non-overlapping windows of `stream`, in a seeded
  random order (`shuffle`) or from its start.  ValueError when the stream holds no window."""
  if (stream.size - 1) // seq < 1:
    raise ValueError(f"the token stream holds {stream.size} tokens, fewer than one window of "
                     f"{seq} + 1")
  order = (corpus_data.window_order(stream.size, seq, seed, epochs=1) if shuffle
           else np.arange((stream.size - 1) // seq))[:n]
  return np.stack([stream[i * seq:(i + 1) * seq] for i in order]).astype(np.int32)


def record(cfg, params, experts, vecs, wins_NxT: np.ndarray, out_dir: str, batch: int = 8,
           windows_per_shard: int = 32, meta: dict | None = None, progress=None) -> int:
  """Writes the shards of (q, quasi, true) for every window; returns the shard count.

  Existing shards are kept (a killed recording resumes where it stopped)."""
  os.makedirs(out_dir, exist_ok=True)
  dv = [jnp.asarray(v) for v in vecs]
  starts = list(range(0, len(wins_NxT), windows_per_shard))
  for i, s in enumerate(progress(starts) if progress else starts):
    path = os.path.join(out_dir, f"shard_{i:05d}.npz")
    if os.path.exists(path):
      continue
    chunk = wins_NxT[s:s + windows_per_shard]
    parts = {"q": [], "quasi": [], "true": []}
    for b in range(0, len(chunk), batch):
      pairs = speculation.predictions(cfg, params, experts, dv, jnp.asarray(chunk[b:b + batch]))
      for k in parts:
        parts[k].append(np.stack([np.asarray(p[k], np.float16) for p in pairs]))
    tmp = path + ".tmp.npz"
    np.savez(tmp, **{k: np.concatenate(v, axis=1) for k, v in parts.items()})
    os.replace(tmp, path)
  with open(os.path.join(out_dir, "meta.json"), "w") as f:
    json.dump(dict(meta or {}, windows=int(len(wins_NxT)), tokens=int(wins_NxT.size),
                   shards=len(starts)), f, indent=2)
  return len(starts)


def previous_probs(true_NxE, seq: int) -> np.ndarray:
  """[N, E] float32: each row's previous row's router probabilities at the same layer
  (`moejax.prefetch.estimator.previous_input` of its true logits), zeros for a window's first
  token (windows of `seq` consecutive rows, as recorded): the estimator's extra input, as
  the engine forms it from the previous token's true routing."""
  true = np.asarray(true_NxE, np.float32)
  last = np.zeros_like(true)
  last[1:] = true[:-1]
  has = np.arange(len(true)) % seq != 0
  out = [np.asarray(estimator.previous_input(jnp.asarray(last[s:s + 65536]),
                                         jnp.asarray(has[s:s + 65536])))
         for s in range(0, len(true), 65536)]
  return np.concatenate(out) if out else np.zeros_like(true)


def load(out_dir: str, pair: int | None = None) -> dict:
  """All shards concatenated: {"q": [P, N, D], ...} (or one pair's [N, ...] arrays)."""
  paths = sorted(glob.glob(os.path.join(out_dir, "shard_*.npz")))
  if not paths:
    raise FileNotFoundError(f"no estimator training shards in {out_dir}")
  out = {}
  for k in ("q", "quasi", "true"):
    arrs = []
    for p in paths:
      try:
        with np.load(p) as z:
          arrs.append(z[k] if pair is None else z[k][pair])
      except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{p}: unreadable estimator shard ({e}); delete it and record again")
    out[k] = np.concatenate(arrs, axis=0 if pair is not None else 1)
  return out
