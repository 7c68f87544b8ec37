"""Synthetic router traces shaped like a larger model, fitted to a measured trace.

The generator (per MoE layer l, expert e, token t):

    logit[t, l, e] = bias[l, e] + scale * (sqrt(w) * z[t, l, e] + sqrt(1 - w) * eps[t, l, e])
    z[t] = rho * z[t-1] + sqrt(1 - rho^2) * xi[t]        (a slowly drifting "topic")

with eps, xi i.i.d. N(0, 1) and z stationary N(0, 1).  `bias` carries per-layer
expert popularity: the measured trace's sorted per-layer selection shares are
interpolated onto the new expert count, log-transformed, centred and assigned to
experts in a random order.  `scale` sets how peaked the gates are (the gate
share by rank), `w` and `rho` how strongly and for how long routing repeats
itself (temporal reuse).

`fit` chooses (scale, w, rho) so that a synthetic trace with the measured
model's own shape reproduces three cheap statistics of the measured trace: the
mean normalised gate share of the first choice, the share of a token's experts
that the previous token also selected (reuse@1), and the share selected at
least once in the previous 16 tokens (reuse@16).  The same parameters then
generate traces with other expert counts, top-k and depths (the scale-up
study); launch/bench_simulator and docs/simulator.md check the fit against the
measured trace's hit-rate-vs-cache-size curve.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import routing
from moejax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GenParams:
  scale: float = 1.0
  topic_weight: float = 0.5     # w
  rho: float = 0.95


def shape_config(num_experts: int, top_k: int, num_layers: int,
                 norm_topk_prob: bool = True) -> ModelConfig:
  """A qwen3_moe config with this routing shape (hidden sizes are irrelevant here)."""
  return ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=64,
                     num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=32,
                     num_experts=num_experts, top_k=top_k, moe_intermediate_size=32,
                     intermediate_size=128, sparse_layers=(True,) * num_layers,
                     qk_norm="head", norm_topk_prob=norm_topk_prob).validate()


def hf_config(cfg: ModelConfig) -> dict:
  return cfg.to_hf_dict()


def _route(cfg: ModelConfig, logits_TxLxR):
  t, nl, r = logits_TxLxR.shape
  ids, gates, _ = jax.jit(routing.route, static_argnums=0)(
      cfg, jnp.asarray(logits_TxLxR, jnp.float32).reshape(t * nl, r))
  return np.asarray(ids).reshape(t, nl, -1), np.asarray(gates).reshape(t, nl, -1)


def measure(cfg: ModelConfig, logits_TxLxR) -> dict:
  """Routing statistics of a trace (per layer, then their means)."""
  ids, gates = _route(cfg, logits_TxLxR)
  t, nl, k = ids.shape
  e = cfg.num_experts
  share = gates / np.maximum(gates.sum(-1, keepdims=True), 1e-20)
  sel = np.zeros((t, nl, e), bool)
  np.put_along_axis(sel, ids, True, axis=-1)
  pop = sel.sum(0) / float(t * k)                                   # [L, E]
  reuse1 = (sel[1:] & sel[:-1]).sum((0, 2)) / float((t - 1) * k)
  seen = np.zeros_like(sel)
  for d in range(1, 17):
    seen[d:] |= sel[:-d]
  reuse16 = (sel[16:] & seen[16:]).sum((0, 2)) / float((t - 16) * k)
  return dict(popularity_sorted=np.sort(pop, axis=1)[:, ::-1], share_by_rank=share.mean((0,)),
              reuse1=reuse1, reuse16=reuse16, first_share=float(share[..., 0].mean()),
              mean_reuse1=float(reuse1.mean()), mean_reuse16=float(reuse16.mean()))


def popularity_bias(popularity_sorted_LxE: np.ndarray, num_experts: int, num_layers: int,
                    rng: np.random.Generator) -> np.ndarray:
  """[L', E'] log-popularity biases: measured layers' sorted shares interpolated onto
  E' experts (layers cycled if L' > L), centred, in a random expert order per layer."""
  src = np.asarray(popularity_sorted_LxE, np.float64)
  out = np.zeros((num_layers, num_experts), np.float32)
  for l in range(num_layers):
    p = src[l % len(src)]
    q = np.interp(np.linspace(0, 1, num_experts), np.linspace(0, 1, len(p)), p)
    b = np.log(np.maximum(q, 1e-12))
    out[l] = rng.permutation(b - b.mean())
  return out


def generate(num_tokens: int, bias_LxE: np.ndarray, gp: GenParams, seed: int = 0,
             dtype=np.float16) -> np.ndarray:
  """[T, L, E] synthetic router logits (see module docstring)."""
  rng = np.random.default_rng(seed)
  nl, e = bias_LxE.shape
  out = np.empty((num_tokens, nl, e), dtype)
  z = rng.standard_normal((nl, e)).astype(np.float32)
  a, b = np.float32(gp.rho), np.float32(np.sqrt(1 - gp.rho ** 2))
  sw, sn = np.float32(gp.scale * np.sqrt(gp.topic_weight)), np.float32(
      gp.scale * np.sqrt(1 - gp.topic_weight))
  for t in range(num_tokens):
    z = a * z + b * rng.standard_normal((nl, e), dtype=np.float32)
    out[t] = bias_LxE + sw * z + sn * rng.standard_normal((nl, e), dtype=np.float32)
  return out


def fit(cfg: ModelConfig, measured: dict, tokens: int = 2048, seed: int = 0,
        scales=(0.75, 1.0, 1.25, 1.5, 2.0), weights=(0.0, 0.1, 0.2, 0.35, 0.5, 0.75),
        rhos=(0.8, 0.95, 0.99)) -> tuple[GenParams, dict]:
  """Grid search for the GenParams whose synthetic trace (the measured model's shape)
  best matches first-choice share, reuse@1 and reuse@16 (squared relative errors)."""
  nl = len(measured["popularity_sorted"])
  bias = popularity_bias(measured["popularity_sorted"], cfg.num_experts, nl,
                         np.random.default_rng(seed))
  want = np.asarray([measured["first_share"], measured["mean_reuse1"],
                     measured["mean_reuse16"]])
  best, best_err, best_stats = None, np.inf, None
  for scale, w, rho in itertools.product(scales, weights, rhos):
    if w == 0.0 and rho != rhos[0]:
      continue                                      # rho does not matter without a topic
    gp = GenParams(scale, w, rho)
    st = measure(cfg, generate(tokens, bias, gp, seed + 1, np.float32))
    got = np.asarray([st["first_share"], st["mean_reuse1"], st["mean_reuse16"]])
    err = float(np.sum(((got - want) / want) ** 2))
    if err < best_err:
      best, best_err, best_stats = gp, err, st
  return best, dict(error=best_err, first_share=best_stats["first_share"],
                    mean_reuse1=best_stats["mean_reuse1"],
                    mean_reuse16=best_stats["mean_reuse16"])
