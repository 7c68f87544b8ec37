"""Router traces: per token and MoE layer, the router's output, on disk.

A trace is a folder:

  trace.json                 metadata (below)
  logits-00000.safetensors   shards of consecutive tokens, each holding
                               router_logits     [n, L, R]  f16 / bf16 / f32
                               token_ids         [n]        int32
                               predicted_logits  [n, L, R]  (optional: a prediction
                                                 of each layer's router output made
                                                 before the layer ran, e.g. by
                                                 speculative prefetch)

L is the number of MoE layers (``moe_layers`` gives their model indices) and R
the router's output width (E, or 2E for sigmoid_group routers: logits then the
correction bias, see moejax.model.routing).  trace.json holds the model's config.json
(so the simulator rebuilds the ModelConfig of any family) and its hash, the
tokenizer, the corpus, the teacher-forcing windows, the document starts (token
offsets after each end-of-text), the token count and the shard list.

Recording is teacher-forced (`record_router_logits`): the fully resident model
runs over non-overlapping windows of the token stream, and each window's router
outputs are kept.  A policy that substitutes experts changes later layers'
inputs, so a trace records the routing of the *unmodified* model; the simulator
replays policies against it (see docs/simulator.md).

Every problem names the file: a missing or truncated shard, a shard whose shape
disagrees with trace.json, a trace recorded from another model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.model.config import ModelConfig
from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, save_file

FORMAT = "moejax-router-trace"
VERSION = 1
META = "trace.json"
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


class TraceError(ValueError):
  """A trace that cannot be used; the message names the file."""


def config_hash(cfg: ModelConfig) -> str:
  """A stable hash of every field of the model config (any family), the family's sub-config
  flattened as when its fields were ModelConfig's (``ModelConfig.flat_dict``)."""
  d = cfg.flat_dict()
  return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: str) -> str | None:
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


@dataclasses.dataclass
class Trace:
  """A loaded trace: arrays in memory, metadata as written."""
  cfg: ModelConfig
  meta: dict
  logits_TxLxR: np.ndarray
  token_ids: np.ndarray
  predicted_TxLxR: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return int(self.logits_TxLxR.shape[0])

  @property
  def windows(self) -> list[tuple[int, int]]:
    """(start, length) of the teacher-forcing windows (context restarts at each)."""
    return [tuple(w) for w in self.meta.get("windows", [[0, self.num_tokens]])]


def write_trace(out_dir: str, model_config: dict, logits_TxLxR, token_ids, *,
                predicted_TxLxR=None, dtype: str = "float16", shard_tokens: int = 65536,
                windows=None, documents=None, info: dict | None = None) -> str:
  """Writes a trace folder; `model_config` is the model's config.json dict."""
  if dtype not in DTYPES:
    raise TraceError(f"--dtype={dtype}: choose one of {', '.join(DTYPES)}")
  cfg = ModelConfig.from_hf_dict(model_config, source="model config")
  logits = np.asarray(logits_TxLxR)
  t, nl, r = logits.shape
  if nl != len(cfg.moe_layers):
    raise TraceError(f"router_logits has {nl} layers, the model has {len(cfg.moe_layers)} "
                     f"MoE layers")
  tokens = np.asarray(token_ids, np.int32)
  if tokens.shape != (t,):
    raise TraceError(f"token_ids has shape {tokens.shape}, expected ({t},)")
  if predicted_TxLxR is not None and np.shape(predicted_TxLxR) != logits.shape:
    raise TraceError(f"predicted_logits has shape {np.shape(predicted_TxLxR)}, expected "
                     f"{logits.shape}")
  os.makedirs(out_dir, exist_ok=True)
  shards = []
  for i, lo in enumerate(range(0, max(t, 1), shard_tokens)):
    hi = min(t, lo + shard_tokens)
    name = f"logits-{i:05d}.safetensors"
    tensors = {"router_logits": logits[lo:hi].astype(DTYPES[dtype]),
               "token_ids": tokens[lo:hi]}
    if predicted_TxLxR is not None:
      tensors["predicted_logits"] = np.asarray(predicted_TxLxR[lo:hi]).astype(DTYPES[dtype])
    save_file(tensors, os.path.join(out_dir, name), metadata={"format": FORMAT})
    shards.append({"file": name, "tokens": hi - lo})
  meta = dict(format=FORMAT, version=VERSION, model_config=model_config,
              config_hash=config_hash(cfg), model_type=cfg.model_type,
              moe_layers=list(cfg.moe_layers), num_experts=cfg.num_experts, top_k=cfg.top_k,
              router_width=r, dtype=dtype, tokens=t, has_predicted=predicted_TxLxR is not None,
              windows=[list(map(int, w)) for w in (windows or [(0, t)])],
              documents=[int(d) for d in (documents or [0])], shards=shards, **(info or {}))
  with open(os.path.join(out_dir, META), "w") as f:
    json.dump(meta, f, indent=1)
  return out_dir


def read_meta(trace_dir: str) -> dict:
  path = os.path.join(trace_dir, META)
  if not os.path.exists(path):
    raise TraceError(f"{path}: no such file (--trace must be a folder written by "
                     f"moejax-trace)")
  try:
    with open(path) as f:
      meta = json.load(f)
  except json.JSONDecodeError as e:
    raise TraceError(f"{path}: not valid JSON ({e})") from None
  if meta.get("format") != FORMAT:
    raise TraceError(f"{path}: not a router trace (format {meta.get('format')!r})")
  if meta.get("version") != VERSION:
    raise TraceError(f"{path}: trace format version {meta.get('version')}, this reader "
                     f"reads version {VERSION}")
  return meta


def load_trace(trace_dir: str, expect: ModelConfig | None = None, max_tokens: int = 0) -> Trace:
  """Reads and checks a trace; `expect`: the model it must come from (else an error)."""
  meta = read_meta(trace_dir)
  meta_path = os.path.join(trace_dir, META)
  cfg = ModelConfig.from_hf_dict(meta["model_config"], source=f"{meta_path}: model_config")
  if config_hash(cfg) != meta["config_hash"]:
    raise TraceError(f"{meta_path}: config_hash {meta['config_hash']} does not match its own "
                     f"model_config ({config_hash(cfg)}): the file was edited or is corrupt")
  if expect is not None and config_hash(expect) != meta["config_hash"]:
    raise TraceError(
        f"{meta_path}: trace recorded from another model ({meta['model_type']}, "
        f"{meta['num_experts']} experts top-{meta['top_k']}, config hash {meta['config_hash']}) "
        f"than the one given ({expect.model_type}, {expect.num_experts} experts top-"
        f"{expect.top_k}, config hash {config_hash(expect)})")
  nl, r = len(meta["moe_layers"]), meta["router_width"]
  logits, tokens, pred = [], [], []
  total = 0
  for sh in meta["shards"]:
    path = os.path.join(trace_dir, sh["file"])
    try:
      f = SafetensorsFile(path)
      lg = f.get("router_logits")
      tk = f.get("token_ids")
      pr = f.get("predicted_logits") if meta.get("has_predicted") else None
    except CheckpointError as e:
      raise TraceError(f"trace shard {e}") from None
    want = (sh["tokens"], nl, r)
    if lg.shape != want or tk.shape != (sh["tokens"],) or (pr is not None and pr.shape != want):
      raise TraceError(f"{path}: router_logits {lg.shape} / token_ids {tk.shape} do not match "
                       f"{meta_path} ({sh['tokens']} tokens x {nl} MoE layers x {r})")
    logits.append(lg)
    tokens.append(tk)
    if pr is not None:
      pred.append(pr)
    total += sh["tokens"]
    if max_tokens and total >= max_tokens:
      break
  if not max_tokens and total != meta["tokens"]:
    raise TraceError(f"{meta_path}: says {meta['tokens']} tokens, its shards hold {total}")
  cut = slice(0, max_tokens or total)
  return Trace(cfg, meta, np.concatenate(logits)[cut], np.concatenate(tokens)[cut],
               np.concatenate(pred)[cut] if pred else None)


# ------------------------------------------------------------------ recording
def record_router_logits(cfg: ModelConfig, params, store, tokens, *, seq: int = 256,
                         batch: int = 4, dtype=jnp.float32, progress: bool = False):
  """Teacher-forced router outputs [T, L, R] (f32) of `tokens`, in windows of `seq`.

  Every window is an independent forward pass of the fully resident model (its
  context starts at the window's first token).  Returns (logits, windows).
  """
  from moejax.model.model import Transformer   # the model only when recording
  model = Transformer(cfg, dtype)
  experts = store.to_device(dtype)
  fwd = jax.jit(lambda p, e, t: [r for r in model.apply({"params": p}, t, e)[2]
                                 if r is not None])
  toks = np.asarray(tokens, np.int32)
  n = len(toks)
  starts = list(range(0, n, seq))
  windows = [(s, min(seq, n - s)) for s in starts]
  out = np.zeros((n, len(cfg.moe_layers), 0), np.float32)
  chunks = []
  it = range(0, len(windows), batch)
  if progress:
    from tqdm import tqdm
    it = tqdm(it, desc="recording router logits", unit="batch", disable=None)  # a terminal
  for b in it:
    group = windows[b:b + batch]
    arr = np.zeros((batch, seq), np.int32)          # one shape: one compile
    for j, (s, ln) in enumerate(group):
      arr[j, :ln] = toks[s:s + ln]
    rl = fwd(params, experts, jnp.asarray(arr))
    rl = np.stack([np.asarray(r, np.float32) for r in rl], axis=2)    # [B, seq, L, R]
    for j, (_, ln) in enumerate(group):
      chunks.append(rl[j, :ln])
  out = np.concatenate(chunks) if chunks else out
  return out, windows
