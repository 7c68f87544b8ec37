"""Speculative expert prefetch, offline half: default vectors and next-layer predictors.

At MoE layer l, once attention is done, the residual stream is r_l.  The next MoE
layer's routing is predicted from

  reuse:  router_{l+1}(Norm_{l+1}(r_l))                  (the current hidden state)
  quasi:  router_{l+1}(Norm_{l+1}(r_l + d_l)),  d_l = sum_k g_k D_l[e_k]

where D_l[e] is the *default vector* of expert e: its mean output over the tokens
routed to it, measured offline and unweighted by the gate, and Norm_{l+1} is the next
layer's pre-MoE norm.  Both go through the next layer's own ``route_logits`` (its norm
and router), so every family's router rule applies unchanged.

Everything here is teacher-forced over whole windows with every expert resident; the
functions are pure and jitted with the config static.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from moejax.model import families, layer_stack, routing
from moejax.model.config import ModelConfig
from moejax.model.experts import apply_experts
from moejax.model.model import Transformer


def _forward_layers(mdl, tokens_BxT, experts, default_vectors=None):
  """Teacher-forced forward recording, per MoE layer, what prediction needs.

  Returns a list over MoE layers of dicts with
    moe_in [N,D], logits [N,E], ids [N,K], gates [N,K], ys [N,K,D] (unweighted outputs
    of the selected experts) and, when default_vectors is given (a list aligned with
    the MoE layers of [E,D] arrays), the next MoE layer's predicted logits
    ``reuse`` and ``quasi`` [N,E] and the quasi-hidden state ``q`` [N,D] (already
    normalised by the next layer's norm; absent on the last MoE layer).
  """
  c = mdl.cfg
  b, t = tokens_BxT.shape
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  x = mdl.embed(tokens_BxT)
  moe_idx = [i for i, s in enumerate(c.sparse_layers) if s]
  recs = []
  for i, layer in enumerate(mdl.layers):
    h, _ = layer.attend(x, pos, None, 0)
    if not c.sparse_layers[i]:
      x = layer.dense_residual(h)
      continue
    moe_in, logits = layer.route_logits(h)
    routed = routing.route(c, logits.reshape(b * t, -1).astype(jnp.float32))
    ids, gates = routed.ids, routed.gates
    flat_in = moe_in.reshape(b * t, -1)
    ones = jnp.ones((b * t, 1), flat_in.dtype)
    ys = jnp.stack([apply_experts(flat_in, ids[:, k:k + 1], ones, experts[i],
                                  swiglu=families.of(c).swiglu(c))
                    for k in range(ids.shape[1])], axis=1)
    rec = {"moe_in": flat_in, "logits": logits.reshape(b * t, -1).astype(jnp.float32),
           "ids": ids, "gates": gates, "ys": ys, "reuse": None, "quasi": None}
    j = moe_idx.index(i)
    if default_vectors is not None and j + 1 < len(moe_idx):
      nxt = mdl.layers[moe_idx[j + 1]]
      r = h.reshape(b * t, -1)
      d = jnp.einsum("nk,nkd->nd", gates.astype(r.dtype), default_vectors[j][ids].astype(r.dtype))
      _, reuse = nxt.route_logits(r)          # (moe_in, router logits)
      rec["reuse"] = reuse.astype(jnp.float32)
      q, quasi = nxt.route_logits(r + d)
      rec["q"], rec["quasi"] = q, quasi.astype(jnp.float32)
    recs.append(rec)
    x = layer.moe_residual(h, moe_in, ids.reshape(b, t, -1), gates.reshape(b, t, -1), experts[i])
  return recs


@functools.partial(jax.jit, static_argnums=(0,))
def default_vector_sums(cfg: ModelConfig, params, experts, tokens_BxT):
  """Per MoE layer: (sum of each expert's unweighted outputs [E,D], token count [E])."""
  recs = Transformer(cfg).apply({"params": params}, tokens_BxT, experts, method=_forward_layers)
  out = []
  for r in recs:
    n, k, d = r["ys"].shape
    flat_ids = r["ids"].reshape(-1)
    sums = jax.ops.segment_sum(r["ys"].reshape(n * k, d).astype(jnp.float32), flat_ids,
                               num_segments=cfg.num_experts)
    counts = jnp.bincount(flat_ids, length=cfg.num_experts)
    out.append((sums, counts))
  return out


def default_vectors(cfg: ModelConfig, params, experts, windows_NxT: np.ndarray, batch: int = 8,
                    progress=None):
  """D_l[e] = mean output of expert e over the tokens routed to it, per MoE layer.

  Returns (list of [E, D] float32 arrays, list of [E] token counts).  An expert never
  selected gets a zero vector and count 0.
  """
  acc = None
  it = range(0, len(windows_NxT), batch)
  for s in (progress(it) if progress else it):
    part = default_vector_sums(cfg, params, experts, jnp.asarray(windows_NxT[s:s + batch]))
    part = [(np.asarray(a, np.float64), np.asarray(c, np.int64)) for a, c in part]
    acc = part if acc is None else [(a0 + a1, c0 + c1) for (a0, c0), (a1, c1) in zip(acc, part)]
  vecs = [(a / np.maximum(c, 1)[:, None]).astype(np.float32) for a, c in acc]
  return vecs, [c for _, c in acc]


@functools.partial(jax.jit, static_argnums=(0,))
def predictions(cfg: ModelConfig, params, experts, default_vecs, tokens_BxT):
  """Per consecutive MoE-layer pair (l, l+1): true logits of l+1 and both predictions."""
  recs = Transformer(cfg).apply({"params": params}, tokens_BxT, experts, default_vecs,
                                method=_forward_layers)
  return [{"true": recs[j + 1]["logits"], "reuse": recs[j]["reuse"], "quasi": recs[j]["quasi"],
           "q": recs[j]["q"]} for j in range(len(recs) - 1)]


def topk_agreement(cfg: ModelConfig, true_logits_NxE, pred_logits_NxE) -> dict:
  """recall@k, exact top-k set match, and the true gate mass the predicted set covers."""
  true = routing.route(cfg, jnp.asarray(true_logits_NxE))
  t_ids, t_gates = true.ids, true.gates
  p_ids = routing.route(cfg, jnp.asarray(pred_logits_NxE)).ids
  hit_NxK = jnp.any(t_ids[:, :, None] == p_ids[:, None, :], axis=-1)
  share = t_gates / jnp.maximum(jnp.sum(t_gates, -1, keepdims=True), 1e-30)
  return {"recall_at_k": float(jnp.mean(hit_NxK)),
          "exact_match": float(jnp.mean(jnp.all(hit_NxK, axis=-1))),
          "mass_covered": float(jnp.mean(jnp.sum(jnp.where(hit_NxK, share, 0.0), -1)))}


def previous_token_agreement(cfg: ModelConfig, true_NxE, seq: int) -> dict:
  """`topk_agreement` of the `previous` predictor: each token's true logits against the
  previous token's, over N tokens in windows of `seq` (a window's first token has no
  previous one and is skipped)."""
  t = np.arange(np.shape(true_NxE)[0])
  t = t[t % seq != 0]
  true = np.asarray(true_NxE, np.float32)
  return topk_agreement(cfg, true[t], true[t - 1])


def default_vectors_dir(model_dir: str) -> str:
  return os.path.join(model_dir.rstrip("/") + "-estimators", "default_vectors")


def save_default_vectors(out: str, vecs, counts, meta: dict):
  os.makedirs(out, exist_ok=True)
  tree = {"vectors": [np.asarray(v) for v in vecs], "counts": [np.asarray(c) for c in counts]}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(os.path.join(out, "orbax")), tree, force=True)
  with open(os.path.join(out, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2)


def load_default_vectors(out: str, cfg) -> list[np.ndarray]:
  """The default vectors saved for this model; refuses those of another model."""
  from moejax.io.traces import config_hash
  meta_path = os.path.join(out, "meta.json")
  if not os.path.exists(meta_path):
    raise FileNotFoundError(f"no default vectors in {out}: run `moejax-default-vectors "
                            f"--model_dir=<the model> --out={out}`")
  meta = json.load(open(meta_path))
  if meta["config_hash"] != config_hash(cfg):
    raise ValueError(f"{meta_path} was made for another model (config hash "
                     f"{meta['config_hash']}, this model {config_hash(cfg)}); rerun "
                     "moejax-default-vectors for this model")
  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(os.path.abspath(os.path.join(out, "orbax")))
  return [np.asarray(v) for v in tree["vectors"]]


# ------------------------------------------------------------------ predictor files
class PrefetchError(ValueError):
  """Missing or mismatched predictor files; the message names the command that makes them."""


def estimators_dir(model_dir: str) -> str:
  return model_dir.rstrip("/") + "-estimators"


HYBRID_SOURCES = ("quasi", "estimator", "previous")   # what the hybrid may use for a pair


def hybrid_sources(meta: dict) -> list[str]:
  """The hybrid's per-pair sources recorded by moejax-train-estimators (files made before
  the `previous` source: the estimator where marked, quasi elsewhere)."""
  return [row.get("hybrid_source", "estimator" if row["hybrid_uses_estimator"] else "quasi")
          for row in meta["per_layer"]]


def load_predictors(kind: str, cfg: ModelConfig, model_dir: str | None = None,
                    directory: str | None = None) -> dict:
  """{"vectors": [E, D] per MoE layer, "estimators": params or None per layer pair,
  "sources": the predictor of each layer pair (`kind`; for hybrid one of `HYBRID_SOURCES`)}.

  quasi and hybrid need the default vectors (moejax-default-vectors), hybrid also the
  estimators and its per-pair choice (moejax-train-estimators), both made for this
  model (config hash); reuse and previous need no files."""
  from moejax.io.traces import config_hash  # pylint: disable=g-import-not-at-top
  n_moe = len(cfg.moe_layers)
  n_pairs = max(0, n_moe - 1)
  out = {"vectors": None, "estimators": [None] * n_pairs,
         "sources": [kind] * n_pairs}
  if kind not in ("quasi", "hybrid"):
    return out
  if directory is None and model_dir is None:
    raise PrefetchError(f"--prefetch={kind} needs the model's default vectors: pass "
                        f"--estimators=DIR or the model folder")
  d = directory or estimators_dir(model_dir)
  vdir = os.path.join(d, "default_vectors")
  try:
    out["vectors"] = load_default_vectors(vdir, cfg)
  except (FileNotFoundError, ValueError) as e:
    raise PrefetchError(f"--prefetch={kind}: {e}") from None
  if kind == "quasi":
    return out
  meta_path = os.path.join(d, "estimators.json")
  if not os.path.exists(meta_path):
    raise PrefetchError(f"--prefetch=hybrid: no trained estimators in {d} (no estimators.json): "
                        f"run `moejax-train-estimators --model_dir=<the model> "
                        f"--out={d}`")
  meta = json.load(open(meta_path))
  if meta.get("config_hash") != config_hash(cfg):
    raise PrefetchError(f"--prefetch=hybrid: {meta_path} was trained for another model "
                        f"(config hash {meta.get('config_hash')}, this model "
                        f"{config_hash(cfg)}); rerun moejax-train-estimators for this model")
  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(os.path.abspath(os.path.join(d, "estimators")))
  pairs = tree["pairs"]
  if len(pairs) != n_pairs or len(meta["per_layer"]) != n_pairs:
    raise PrefetchError(f"{d}: {len(pairs)} estimators for {n_pairs} MoE layer pairs; rerun "
                        f"moejax-train-estimators for this model")
  out["sources"] = hybrid_sources(meta)
  for j, src in enumerate(out["sources"]):
    if src not in HYBRID_SOURCES:
      raise PrefetchError(f"{meta_path}: pair {j} has hybrid source {src!r}; rerun "
                          f"moejax-train-estimators")
    if src == "estimator":
      kernel = np.asarray(pairs[j]["params"]["w_out"]["kernel"])
      if kernel.shape[-1] != cfg.num_experts:
        raise PrefetchError(f"{d}: estimator {j} predicts {kernel.shape[-1]} experts, the "
                            f"model has {cfg.num_experts}; rerun moejax-train-estimators")
      rows = np.asarray(pairs[j]["params"]["w_in"]["kernel"]).shape[0]
      dim, width = cfg.hidden_size, routing.router_width(cfg)
      if rows not in (dim, dim + width):
        raise PrefetchError(f"{d}: estimator {j} takes {rows} inputs, this model's q has "
                            f"{dim} (and the previous token's router logits {width} more); rerun "
                            f"moejax-train-estimators")
      out["estimators"][j] = jax.tree_util.tree_map(jnp.asarray, pairs[j])
  widths = {np.shape(e["params"]["w_in"]["kernel"]) for e in out["estimators"] if e is not None}
  if len(widths) > 1:
    raise PrefetchError(f"{d}: the estimators differ in shape ({sorted(widths)}); rerun "
                        f"moejax-train-estimators")
  return out


def _predictors(kind: str, cfg: ModelConfig, predictors: dict | None) -> dict:
  """The given predictors, else the shipped ones; quasi and hybrid need default vectors."""
  preds = predictors or load_predictors(kind, cfg)
  if kind in ("quasi", "hybrid") and preds["vectors"] is None:
    raise PrefetchError(f"--prefetch={kind} needs default vectors: run "
                        f"`moejax-default-vectors --model_dir=<the model>`")
  n_pairs = max(0, len(cfg.moe_layers) - 1)
  if kind != "hybrid":
    preds = dict(preds, sources=[kind] * n_pairs)
  elif "sources" not in preds:   # a hand-made dict: the estimator wherever there is one
    preds = dict(preds, sources=["estimator" if e is not None else "quasi"
                                 for e in preds["estimators"]])
  return preds


def stacked_predictors(cfg: ModelConfig, kind: str, predictors: dict | None,
                       stack: bool = True):
  """Per layer: the default vectors D_l (to form d_l), the estimator that predicts
  layer l from the MoE layer before it (zero correction where none: W_out = 0 is the
  plain quasi prediction) and whether layer l takes the previous token's routing
  (the hybrid's `previous` source), stacked like the layers (`layer_stack.stack_layers`), for the emulator's scan."""
  preds = _predictors(kind, cfg, predictors)
  zero_v = jnp.zeros((cfg.num_experts, cfg.hidden_size), jnp.float32)
  moe = list(cfg.moe_layers)
  vec = {l: (jnp.asarray(preds["vectors"][j], jnp.float32) if preds["vectors"] is not None
             else zero_v) for j, l in enumerate(moe)}
  use_est = [src == "estimator" and e is not None
             for src, e in zip(preds["sources"], preds["estimators"])]
  ests = [e for e, u in zip(preds["estimators"], use_est) if u]
  zero_e = jax.tree_util.tree_map(jnp.zeros_like, ests[0]) if ests else None
  est = {l: (preds["estimators"][j - 1] if j and use_est[j - 1] else zero_e)
         for j, l in enumerate(moe)}
  last = {l: jnp.bool_(j > 0 and preds["sources"][j - 1] == "previous") for j, l in enumerate(moe)}
  xs = [{"vectors": vec.get(i, zero_v), "est": est.get(i, zero_e),
         "use_last": last.get(i, jnp.bool_(False))} for i in range(cfg.num_layers)]
  if stack and layer_stack.uniform(cfg):
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
  return xs
