"""Routers for the random benchmark models that route like a trained model's.

Why.  A random router over random hidden states does not route like a trained MoE.  With
std-0.5 routers the wide model's later layers sent most tokens to the same few experts
whatever the token (the 8 busiest of 128 took 31-35% of the calls, an LRU of 25% hit 92%),
so every cache figure measured on it was flattered.  A router that reads only the token's
own random embedding goes the other way: no locality at all (an LRU of 25% hits 28%, no
better than chance).  A trained model sits in between: the experts a token picks depend on
the token and on its context, and the context changes slowly along a text, so an LRU of 25%
hits about 0.7-0.8 (the demo model 0.69, Qwen3-Next's published LRU-128 of 512 about 0.81);
a load-balancing loss keeps every expert busy over a long text.

How.  A few residual dimensions are reserved (``Layout``), written by the embedding and by
one attention head, and read by the routers; every other weight neither reads nor writes
them, so what the routers see is known exactly and computed here in numpy (``inputs``):

  CONST  one dimension, the same value for every token: a router's bias (Qwen3-MoE's
         router has no bias term of its own) and the constant query / key below;
  TOK    R dimensions, the token's own random direction ("what this token is");
  VAL    R dimensions, a second random direction, scaled by 1/sqrt(token frequency) on a
         calibration text (rare tokens, like a trained model's content words, carry the
         topic; frequent ones, like whitespace, little);
  CTX    R dimensions, written by two heads of the first layer.  Each head's query and key
         are the constant dimension on two RoPE frequencies (q_norm / k_norm scale the
         score), so its attention weights are softmax(s/2 (cos a d + cos b d)) over the
         distance d whatever the tokens: a window back from the token.  Both heads' values
         are VAL.  Head 0 (a window of about 6 tokens) adds its average to CTX; the first
         head of the second kv group (about 40 tokens) subtracts BETA of its own.  CTX is
         then a running, topic-weighted summary of the recent text with the document's
         slowly changing part taken out: without it, a document's recurring names favoured
         the same few experts for the whole document (the 8 busiest took up to 13.5% of a
         layer's calls on the held-out text; uniform 6.25%).

Layer l's router: logits = A_l . TOK + B_l . CTX + bias_l (all over the same RMS norm), with
A_l, B_l random and the context's weight rising with depth (trained models' later layers
are more local).  The biases balance the load on the calibration text (the train split,
never the held-out text the statistics are read on), the way an aux-loss-free balancing
bias does; one scale on all logits sets the gates' spread (the first choice's mean share of
the top-k gates; the demo model's layers: 0.34-0.54).

The result on the held-out text is measured, not assumed: `stats` (tests/test_routing.py on
a small model of this construction; docs/results.md for the wide models).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.model.config import ModelConfig
from benchmarks.locality import cache_hit_rate, load_shares

R_MAX = 64              # dims of each reserved group (fewer if the head or model is small)
CONST = 32.0            # the constant dimension's value (dominates the RMS: a stable norm)
TOK_STD = 1.0
WINDOW_S = 64.0         # the context heads' score scale per frequency
WINDOWS = (0.0108, 0.0022)  # their RoPE angles per position (nearest of the model's): the
                        # window's std is about 1 / (angle sqrt(2 s)): 8 and 40 tokens
BETA = 0.7              # the long window's share subtracted from the short one's
MIX = (1.9, 3.8)        # the context term's std relative to the token term, first -> last layer
GATE_TOP1 = 0.42        # target mean share of the first choice among the top-k gates
FREQ_POWER = 0.5        # VAL scale: frequency ** -FREQ_POWER


@dataclasses.dataclass(frozen=True)
class Head:
  """One context head of the first layer: its kv head, its query head (the first of the kv
  head's group), its two RoPE frequencies (indices into head_dim / 2) and its output's sign
  and weight."""
  kv: int
  q: int
  pairs: tuple[int, int]
  weight: float


@dataclasses.dataclass(frozen=True)
class Layout:
  """The reserved residual dimensions and the context heads."""
  r: int
  heads: tuple[Head, ...]

  @property
  def width(self) -> int:     # CONST + TOK + VAL + CTX
    return 1 + 3 * self.r

  def tok(self):
    return slice(1, 1 + self.r)

  def val(self):
    return slice(1 + self.r, 1 + 2 * self.r)

  def ctx(self):
    return slice(1 + 2 * self.r, 1 + 3 * self.r)


def layout(cfg: ModelConfig) -> Layout:
  hd = cfg.head_dim
  r = min(R_MAX, hd, (cfg.hidden_size - 1) // 6)
  if r < 4 or cfg.num_kv_heads < 2:
    raise ValueError(f"hidden {cfg.hidden_size} / head_dim {hd} / {cfg.num_kv_heads} kv heads: "
                     "too small for the routed benchmark construction (needs 4 reserved dims "
                     "a group and two kv heads)")
  inv = cfg.rope_theta ** (-np.arange(0, hd, 2) / hd)
  group = cfg.num_heads // cfg.num_kv_heads
  heads = []
  for kv, (angle, w) in enumerate(zip(WINDOWS, (1.0, -BETA))):
    i = min(int(np.argmin(np.abs(np.log(inv) - np.log(angle)))), hd // 2 - 2)
    heads.append(Head(kv=kv, q=kv * group, pairs=(i, i + 1), weight=w))
  return Layout(r=r, heads=tuple(heads))


@dataclasses.dataclass(frozen=True)
class Design:
  """Every designed value (numpy float32); `fix` writes them into the random tensors."""
  cfg: ModelConfig
  lay: Layout
  embed_VxW: np.ndarray        # the reserved columns of each token's embedding
  a_LxExR: np.ndarray          # router weights on TOK
  b_LxExR: np.ndarray          # router weights on CTX
  bias_LxE: np.ndarray         # router weights on CONST
  qk_norm: float               # q_norm / k_norm weight on the two pairs (score scale)


def token_frequencies(ids, vocab: int) -> np.ndarray:
  return np.bincount(np.asarray(ids, np.int64), minlength=vocab)[:vocab].astype(np.float64)


def inputs(d: Design, ids, seq: int = 0):
  """What layer l's router reads, before its weights: (tok [T, R], ctx [T, R], one [T]),
  each already divided by the token's RMS (the post-attention norm), as the model computes
  them (up to its rounding and the other layers' small writes to the RMS).  The context
  restarts every `seq` tokens (0: never), as a teacher-forced window does."""
  ids = np.asarray(ids, np.int64)
  lay, cfg = d.lay, d.cfg
  h_TxW = d.embed_VxW[ids].astype(np.float64)
  rest = (cfg.hidden_size - lay.width) * 0.02 ** 2          # the random dims' mean square
  rms_T = np.sqrt(((h_TxW ** 2).sum(1) + rest) / cfg.hidden_size)
  v_TxR = h_TxW[:, lay.val()] / rms_T[:, None]
  inv = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
  s = np.sqrt(cfg.head_dim) * d.qk_norm ** 2 / 2
  ctx_TxR = np.zeros_like(v_TxR)
  for t in range(len(ids)):
    t0 = (t // seq) * seq if seq else 0
    dist = t - np.arange(t0, t + 1)
    for head in lay.heads:
      sc = s * sum(np.cos(inv[i] * dist) for i in head.pairs)
      w = np.exp(sc - sc.max())
      ctx_TxR[t] += head.weight * ((w / w.sum()) @ v_TxR[t0:t + 1])
  rms2_T = np.sqrt(rms_T ** 2 + (ctx_TxR ** 2).sum(1) / cfg.hidden_size)
  return (h_TxW[:, lay.tok()] / rms2_T[:, None], ctx_TxR / rms2_T[:, None],
          CONST / rms2_T)


def logits(d: Design, ids, seq: int = 0) -> np.ndarray:
  """The routers' logits [T, L, E] as `inputs` predicts them."""
  tok, ctx, one = inputs(d, ids, seq)
  return (np.einsum("tr,ler->tle", tok, d.a_LxExR) + np.einsum("tr,ler->tle", ctx, d.b_LxExR)
          + one[:, None, None] * d.bias_LxE[None])


def _top_k(lg, k):
  return np.argpartition(-lg, k - 1, axis=-1)[..., :k]


def _balance(lg_LxTxE, k: int, steps: int = 80) -> np.ndarray:
  """Per-expert logit offsets [L, E] that even out each layer's top-k load on these logits."""
  n_l, _, e = lg_LxTxE.shape
  off = np.zeros((n_l, 1, e))
  scale = lg_LxTxE.std()
  for i in range(steps):
    sel = _top_k(lg_LxTxE + off, k)
    load = np.stack([np.bincount(s.ravel(), minlength=e) for s in sel]) / sel[0].size * e
    off[:, 0] -= (0.1 if i < steps // 2 else 0.03) * scale * (load - 1)
  return off[:, 0]


def _top1_share(lg_TxE, k: int) -> float:
  top = -np.sort(-lg_TxE, -1)[:, :k]
  p = np.exp(top - top[:, :1])
  return float((p[:, 0] / p.sum(1)).mean())


def design(cfg: ModelConfig, calib_ids, freq_ids=None, seed: int = 0) -> Design:
  """The routing of `cfg` (a Qwen3-MoE shape), calibrated on the token ids `calib_ids`
  (biases, gate scale) with token frequencies from `freq_ids` (default: the same)."""
  lay = layout(cfg)
  rng = np.random.default_rng([seed, 1234])
  v, r, e, n_l = cfg.vocab_size, lay.r, cfg.num_experts, len(cfg.moe_layers)
  freq = token_frequencies(calib_ids if freq_ids is None else freq_ids, v) + 1.0
  emb = np.zeros((v, lay.width), np.float32)
  emb[:, 0] = CONST
  emb[:, lay.tok()] = rng.standard_normal((v, r)) * TOK_STD
  emb[:, lay.val()] = rng.standard_normal((v, r)) * (freq ** -FREQ_POWER)[:, None] * TOK_STD
  qk = float(np.sqrt(2 * WINDOW_S / np.sqrt(cfg.head_dim)))
  zero = np.zeros((n_l, e, r))
  d = Design(cfg, lay, emb, zero, zero, np.zeros((n_l, e)), qk)
  tok, ctx, one = inputs(d, calib_ids)
  depth = np.linspace(0.0, 1.0, n_l) if n_l > 1 else np.zeros(1)
  a = rng.standard_normal((n_l, e, r)) / np.sqrt((tok ** 2).sum(1).mean())
  b = rng.standard_normal((n_l, e, r)) / np.sqrt((ctx ** 2).sum(1).mean())
  b *= (MIX[0] + (MIX[1] - MIX[0]) * depth)[:, None, None]
  lg = np.einsum("tr,ler->lte", tok, a) + np.einsum("tr,ler->lte", ctx, b)
  k = cfg.top_k
  lo, hi = 0.05, 20.0                     # one scale: the first choice's mean gate share
  for _ in range(30):
    mid = np.sqrt(lo * hi)
    shares = [_top1_share(mid * lg[l], k) for l in range(n_l)]
    lo, hi = (mid, hi) if np.mean(shares) < GATE_TOP1 else (lo, mid)
  scale = np.sqrt(lo * hi)
  bias = _balance(scale * lg, k) / one.mean()
  return Design(cfg, lay, emb, (scale * a).astype(np.float32), (scale * b).astype(np.float32),
                bias.astype(np.float32), qk)


def stats(ids_TxLxK, num_experts: int, fraction: float = 0.25, seed: int = 0) -> dict:
  """The routing statistics every benchmark reports: per layer and mean, the hit rate of an
  LRU holding `fraction` of the experts (the same tokens shuffled beside it: popularity
  without locality) and the 8 busiest experts' share of the calls (uniform: 8 / E)."""
  ids = np.asarray(ids_TxLxK)
  cap = max(1, int(round(fraction * num_experts)))
  hit = cache_hit_rate(ids, num_experts, cap)
  perm = np.random.default_rng(seed).permutation(len(ids))
  shuf = cache_hit_rate(ids[perm], num_experts, cap)
  busy = np.sort(load_shares(ids, num_experts), 1)[:, -8:].sum(1)
  r3 = lambda x: [round(float(v), 4) for v in x]
  return {"tokens": int(len(ids)), "lru_fraction": fraction, "lru_slots": cap,
          "lru_hit_mean": round(float(hit.mean()), 4), "lru_hit_per_layer": r3(hit),
          "lru_hit_shuffled_mean": round(float(shuf.mean()), 4),
          "busiest8_share_max": round(float(busy.max()), 4), "busiest8_share_per_layer": r3(busy),
          "busiest8_uniform": 8 / num_experts}


def top_k_ids(logits_TxLxE, k: int) -> np.ndarray:
  """The router's selections [T, L, k] (order within a token does not matter to an LRU)."""
  return _top_k(np.asarray(logits_TxLxE, np.float32), k)


def fix(d: Design, name: str, row0: int, arr: np.ndarray) -> np.ndarray:
  """The random chunk `arr` (rows row0.. of the HF tensor `name`, float32) with the
  design written in: the reserved dimensions are neither read nor written by any weight
  but the designed ones (columns of what reads the residual, rows of what writes it)."""
  lay, cfg, w = d.lay, d.cfg, d.lay.width
  rows = np.arange(row0, row0 + arr.shape[0])
  layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
  hd = cfg.head_dim
  if name == "model.embed_tokens.weight":
    arr[:, :w] = d.embed_VxW[rows]
  elif name.endswith("mlp.gate.weight"):                       # the router: all designed
    l = cfg.moe_layers.index(layer)
    arr[:] = 0.0
    arr[:, 0] = d.bias_LxE[l][rows]
    arr[:, lay.tok()] = d.a_LxExR[l][rows]
    arr[:, lay.ctx()] = d.b_LxExR[l][rows]
  elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
    arr[:, :w] = 0.0
    if layer == 0:                         # the context heads
      kind = name.split(".")[-2][0]        # q, k or v
      for head in lay.heads:
        first = (head.q if kind == "q" else head.kv) * hd
        for j in np.nonzero((rows >= first) & (rows < first + hd))[0]:
          arr[j] = 0.0
          i = rows[j] - first
          if kind == "v" and i < lay.r:
            arr[j, lay.val().start + i] = 1.0
          elif kind != "v" and i in head.pairs:
            arr[j, 0] = 1.0
  elif name.endswith(("q_norm.weight", "k_norm.weight")) and layer == 0:
    for head in lay.heads:
      arr[list(head.pairs)] = d.qk_norm
  elif name.endswith("o_proj.weight"):
    arr[rows < w] = 0.0
    if layer == 0:
      for j in np.nonzero((rows >= lay.ctx().start) & (rows < lay.ctx().stop))[0]:
        for head in lay.heads:
          arr[j, head.q * hd + rows[j] - lay.ctx().start] = head.weight
  elif name.endswith(("gate_proj.weight", "up_proj.weight")) or name.endswith("gate_up_proj"):
    arr[..., :w] = 0.0
  elif name.endswith("down_proj.weight"):
    arr[rows < w] = 0.0
  elif name.endswith("experts.down_proj"):       # fused [E, D, I]
    arr[:, :w] = 0.0
  return arr


def seen(records, engine_stats: dict, num_experts: int) -> dict:
  """The routing a benchmark saw, reported beside its speed: the engine's hit rate and
  misses per token (its own cache), and, from the router's selections in its records (the
  token stream's routing, whatever the engine's cache), the LRU hit at 25% and the 8
  busiest experts' share (`stats` above)."""
  ids = np.asarray([[lr.ids for _, lr in sorted(r.layers.items())] for r in records])
  out = {"hit_rate": engine_stats.get("hit_rate"),
         "misses_per_token": engine_stats.get("misses_per_token")}
  if ids.size:
    out["stream"] = stats(ids, num_experts)
  return out
