"""Speculative expert prefetch: the engine's setting and the predictors' files.

  preds = prefetch.load_predictors("quasi", cfg, "ckpts/demo")   # default vectors (+ estimators)
  OffloadEngine(..., prefetch=Prefetch("quasi", "true_router", preds))

Per decoded token and MoE layer l, inside the decode program (`layer.moe_layer`,
`prefetch_steps`): layer l's experts are predicted at layer l from the previous MoE
layer's (r, d) (or taken from the previous token); the predicted experts not resident
are copied into the layer's K prefetch rows (never a slot the cache holds, so a
prefetch never evicts an expert this token needs) and count as resident for the
decision; the executed ones are then inserted into the cache like fetched experts (not
in streaming).  An expert predicted again at the next token is copied again.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from moejax import layer_stack, routing, speculation
from moejax.config import ModelConfig


class PrefetchError(ValueError):
  """Missing or mismatched predictor files; the message names the command that makes them."""


def estimators_dir(model_dir: str) -> str:
  return model_dir.rstrip("/") + "-estimators"


HYBRID_SOURCES = ("quasi", "estimator", "previous")   # what the hybrid may use for a pair


def hybrid_sources(meta: dict) -> list[str]:
  """The hybrid's per-pair sources recorded by launch.train_estimators (files made before
  the `previous` source: the estimator where marked, quasi elsewhere)."""
  return [row.get("hybrid_source", "estimator" if row["hybrid_uses_estimator"] else "quasi")
          for row in meta["per_layer"]]


def load_predictors(kind: str, cfg: ModelConfig, model_dir: str | None = None,
                    directory: str | None = None) -> dict:
  """{"vectors": [E, D] per MoE layer, "estimators": params or None per layer pair,
  "sources": the predictor of each layer pair (`kind`; for hybrid one of `HYBRID_SOURCES`)}.

  quasi and hybrid need the default vectors (launch.default_vectors), hybrid also the
  estimators and its per-pair choice (launch.train_estimators), both made for this
  model (config hash); reuse and previous need no files."""
  from moejax.traces import config_hash  # pylint: disable=g-import-not-at-top
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
    out["vectors"] = speculation.load_default_vectors(vdir, cfg)
  except (FileNotFoundError, ValueError) as e:
    raise PrefetchError(f"--prefetch={kind}: {e}") from None
  if kind == "quasi":
    return out
  meta_path = os.path.join(d, "estimators.json")
  if not os.path.exists(meta_path):
    raise PrefetchError(f"--prefetch=hybrid: no trained estimators in {d} (no estimators.json): "
                        f"run `python -m launch.train_estimators --model_dir=<the model> "
                        f"--out={d}`")
  meta = json.load(open(meta_path))
  if meta.get("config_hash") != config_hash(cfg):
    raise PrefetchError(f"--prefetch=hybrid: {meta_path} was trained for another model "
                        f"(config hash {meta.get('config_hash')}, this model "
                        f"{config_hash(cfg)}); rerun launch.train_estimators for this model")
  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(os.path.abspath(os.path.join(d, "estimators")))
  pairs = tree["pairs"]
  if len(pairs) != n_pairs or len(meta["per_layer"]) != n_pairs:
    raise PrefetchError(f"{d}: {len(pairs)} estimators for {n_pairs} MoE layer pairs; rerun "
                        f"launch.train_estimators for this model")
  out["sources"] = hybrid_sources(meta)
  for j, src in enumerate(out["sources"]):
    if src not in HYBRID_SOURCES:
      raise PrefetchError(f"{meta_path}: pair {j} has hybrid source {src!r}; rerun "
                          f"launch.train_estimators")
    if src == "estimator":
      kernel = np.asarray(pairs[j]["params"]["w_out"]["kernel"])
      if kernel.shape[-1] != cfg.num_experts:
        raise PrefetchError(f"{d}: estimator {j} predicts {kernel.shape[-1]} experts, the "
                            f"model has {cfg.num_experts}; rerun launch.train_estimators")
      rows = np.asarray(pairs[j]["params"]["w_in"]["kernel"]).shape[0]
      dim, width = cfg.hidden_size, routing.router_width(cfg)
      if rows not in (dim, dim + width):
        raise PrefetchError(f"{d}: estimator {j} takes {rows} inputs, this model's q has "
                            f"{dim} (and the previous token's router logits {width} more); rerun "
                            f"launch.train_estimators")
      out["estimators"][j] = jax.tree_util.tree_map(jnp.asarray, pairs[j])
  widths = {np.shape(e["params"]["w_in"]["kernel"]) for e in out["estimators"] if e is not None}
  if len(widths) > 1:
    raise PrefetchError(f"{d}: the estimators differ in shape ({sorted(widths)}); rerun "
                        f"launch.train_estimators")
  return out


def _predictors(kind: str, cfg: ModelConfig, predictors: dict | None) -> dict:
  """The given predictors, else the shipped ones; quasi and hybrid need default vectors."""
  preds = predictors or load_predictors(kind, cfg)
  if kind in ("quasi", "hybrid") and preds["vectors"] is None:
    raise PrefetchError(f"--prefetch={kind} needs default vectors: run "
                        f"`python -m launch.default_vectors --model_dir=<the model>`")
  n_pairs = max(0, len(cfg.moe_layers) - 1)
  if kind != "hybrid":
    preds = dict(preds, sources=[kind] * n_pairs)
  elif "sources" not in preds:   # a hand-made dict: the estimator wherever there is one
    preds = dict(preds, sources=["estimator" if e is not None else "quasi"
                                 for e in preds["estimators"]])
  return preds


@dataclasses.dataclass(frozen=True)
class Prefetch:
  """The engine's speculative prefetch: the predictor `kind` (prefetch_steps.PREFETCH;
  "none": off), speculative execution, the predictors' files (`load_predictors`; None:
  the shipped ones) and `streaming` (no expert cache: every expert of a token is fetched
  or prefetched)."""
  kind: str = "none"
  speculative: str = "off"
  predictors: dict | None = dataclasses.field(default=None, compare=False, hash=False)
  streaming: bool = False


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
