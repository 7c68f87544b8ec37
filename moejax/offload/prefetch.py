"""Speculative expert prefetch in the engine: the predictors' files and the host side.

  preds = prefetch.load_predictors("quasi", cfg, "ckpts/demo")   # default vectors (+ estimators)
  OffloadEngine(..., prefetch="quasi", speculative="true_router", predictors=preds)

Per decoded token and MoE layer l (see `prefetch_steps` for the jitted parts):
  1. the layer decides on the view in which the experts prefetched for it count as
     resident (requested at layer l-1; the engine waits for them if they have not
     arrived, `prefetch_wait_s`);
  2. right after the decision, layer l+1's experts are predicted from r_l (and d_l) and
     those not resident in l+1's cache are requested on the prefetch thread (background
     priority, behind the synchronous fetches) into l+1's K reserved prefetch rows: a
     prefetch never takes a slot, so it never evicts an expert this token needs;
  3. the layer's experts run from `slots ++ prefetch rows`; prefetched experts it did
     not execute are cancelled if still queued (else their bytes are *wasted*); the
     executed ones are inserted into the cache like fetched experts (not in streaming).
Prefetched experts are not kept past their layer: an expert predicted again at the next
token is requested again.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from moejax import layer_stack, routing, speculation
from moejax.config import ModelConfig
from moejax.offload import prefetch_steps as pf_steps
from moejax.offload import steps as steps_lib
from moejax.offload import tickets as tickets_lib


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


class Speculator:
  """The engine's prefetch state for the token in flight (host side)."""

  def __init__(self, cfg: ModelConfig, dtype, mode: pf_steps.Mode, predictors: dict | None,
               prefetcher, states: dict, put, host_rows: bool, zero_rows: dict,
               timeout_s: float, expert_nbytes: int, admitting=lambda l: set()):
    self.cfg, self.dtype, self.mode = cfg, dtype, mode
    self.moe_layers = tuple(cfg.moe_layers)
    self.prefetcher, self.states, self.put = prefetcher, states, put
    self.host_rows, self.zero_rows, self.timeout_s = host_rows, zero_rows, timeout_s
    self.expert_nbytes, self.admitting = expert_nbytes, admitting
    k, e, d = cfg.top_k, cfg.num_experts, cfg.hidden_size
    preds = _predictors(mode.prefetch, cfg, predictors)
    zero_v = np.zeros((e, d), np.float32)
    self.vectors = {l: put(np.asarray(preds["vectors"][j]) if preds["vectors"] is not None
                           else zero_v) for j, l in enumerate(self.moe_layers)}
    self.sources = {self.moe_layers[j]: src for j, src in enumerate(preds["sources"])}
    self.estimators = {self.moe_layers[j]: (put(t) if t is not None and
                                            self.sources[self.moe_layers[j]] == "estimator"
                                            else None)
                       for j, t in enumerate(preds["estimators"])}
    self.no_pf = np.full(k, -1, np.int32)
    self.no_pred = put(np.zeros((1, routing.router_width(cfg)), np.float32))
    # layer -> (requested ids, their tickets, predicted logits, predicted ids, the
    # layer's ResidentState at the request)
    self.pending: dict[int, tuple] = {}
    self.drain: list = []
    self.last: dict[int, tuple[object, list[int]]] = {}   # layer -> previous token's routing

  def new_sequence(self):
    """A new prompt: no previous token to predict from."""
    self.last = {}

  def remember(self, l: int, true_logits, true_ids: np.ndarray):
    """Layer l's true routing at this token: the `previous` source's next prediction."""
    self.last[l] = (true_logits, [int(e) for e in true_ids])

  def predict_args(self, l: int, params) -> tuple | None:
    """The prediction inputs of layer l's call (None where it predicts nothing): the next
    MoE layer's parameters, layer l's default vectors, its estimator and the next layer's
    true logits at the previous token with whether there was one (an estimator's
    optional input, `estimators.model`)."""
    if not self.predicts(l):
      return None
    n = self.next_layer(l)
    last = self.last.get(n)
    return (params[f"layers_{n}"], self.vectors[l], self.estimators.get(l),
            last[0] if last is not None else self.no_pred, np.bool_(last is not None))

  def next_layer(self, l: int) -> int | None:
    j = self.moe_layers.index(l)
    return self.moe_layers[j + 1] if j + 1 < len(self.moe_layers) else None

  def take(self, l: int, rec):
    """(pf_ids [K], predicted logits [1, E'], whether there is a prediction, tickets) for
    layer l: what the MoE layer before it asked for, brought up to date with the
    admissions inserted into layer l since (`_recheck`)."""
    got = self.pending.pop(l, None)
    if got is None:
      return self.no_pf.copy(), self.no_pred, np.bool_(False), []
    ids, tickets, pred, wanted, state = got
    if self.states[l] is not state:   # an admission was inserted since the request
      ids, tickets = self._recheck(l, wanted, ids, tickets, rec)
    pf = self.no_pf.copy()
    pf[:len(ids)] = ids
    return pf, pred, np.bool_(True), tickets

  def _recheck(self, l: int, wanted: list[int], ids: list[int], tickets: list, rec):
    """The prefetch set is the predicted experts not resident *at the decision*: an
    admission inserted after the request may have made a requested expert resident
    (its prefetch is withdrawn) or evicted a predicted one (requested now).  So the
    set does not depend on when the admission's transfer finished."""
    slot = np.asarray(self.states[l].expert_slot)
    need = [e for e in wanted if slot[e] < 0]
    keep = [(e, t) for e, t in zip(ids, tickets) if e in need]
    for e, t in zip(ids, tickets):
      if e not in need:
        rec.prefetches -= 1
        if t.cancel():
          rec.prefetch_bytes -= self.expert_nbytes
        else:
          self.drain.append(t)
          rec.wasted_bytes += self.expert_nbytes
    new = [e for e in need if e not in ids]
    if new:
      keep += zip(new, self.prefetcher.request_many(l, new, tickets_lib.BACKGROUND,
                                                    pad_to=self.cfg.top_k))
      rec.prefetches += len(new)
      rec.prefetch_bytes += len(new) * self.expert_nbytes
    rec.layer(l).prefetched = [e for e, _ in keep]
    return [e for e, _ in keep], [t for _, t in keep]

  def request(self, n: int, pred_logits, pred_ids, rec):
    """Requests layer n's predicted experts that are neither resident nor queued for
    admission (background)."""
    self._collect_drained()
    ids = [int(e) for e in np.asarray(pred_ids)]
    slot, admitting = np.asarray(self.states[n].expert_slot), self.admitting(n)
    missing = [e for e in ids if slot[e] < 0 and e not in admitting]
    tickets = (self.prefetcher.request_many(n, missing, tickets_lib.BACKGROUND,
                                            pad_to=self.cfg.top_k) if missing else [])
    self.pending[n] = (missing, tickets, pred_logits, ids, self.states[n])
    rec.prefetches += len(missing)
    rec.prefetch_bytes += len(missing) * self.expert_nbytes
    rec.layer(n).predicted = ids
    rec.layer(n).prefetched = missing

  def predicts(self, l: int) -> bool:
    """Whether layer l's call predicts the next MoE layer's routing (not at the last
    MoE layer, for a `previous` source (no computation) or the `oracle` check)."""
    return (self.next_layer(l) is not None and self.mode.prefetch != "oracle"
            and self.sources.get(l) != "previous")

  def predict_next(self, l: int, pred, rec):
    """Step 2 after layer l's decision: requests the next MoE layer's predicted experts
    not resident; `pred` = (logits on the device, ids [K]) computed in layer l's call
    (`predicts`), or the previous token's routing for a `previous` source (`oracle`:
    `oracle_next`)."""
    n = self.next_layer(l)
    if n is None or self.mode.prefetch == "oracle":
      return
    if self.sources.get(l) == "previous":   # no computation: the previous token's selection
      if n in self.last:
        self.request(n, *self.last[n], rec)
      return
    self.request(n, *pred, rec)

  def oracle_next(self, l: int, layer_params: dict, x, tp, cache: dict, rec):
    """The `oracle` check: layer l+1's true routing, from layer l's output x."""
    n = self.next_layer(l)
    if n != l + 1 or self.mode.prefetch != "oracle":
      return
    step = pf_steps.oracle_step(self.cfg, self.dtype, steps_lib.representative(self.cfg, n))
    logits, ids = step(layer_params[f"layers_{n}"], x, tp, cache[n])
    self.request(n, logits, ids, rec)

  def rows(self, l: int, pf_ids: np.ndarray, tickets: list, exec_ids: np.ndarray, rec):
    """Waits for the prefetched experts layer l executes; cancels the others if still
    queued.  Returns the prefetch rows {name: [K, ...]} (zeros where unused) and pf_ids
    with the unused ones cleared."""
    used = set(int(e) for e in exec_ids if e >= 0)
    k = self.cfg.top_k
    rows = None
    pf_used = np.full(k, -1, np.int32)
    t0 = time.perf_counter()
    for j, t in enumerate(tickets):
      e = int(pf_ids[j])
      if e not in used:
        if not t.cancel():
          self.drain.append(t)
          rec.wasted_bytes += self.expert_nbytes
        continue
      arr = t.wait(self.timeout_s)
      if rows is None:
        rows = {n: np.zeros((k,) + np.shape(v), np.asarray(v).dtype) if self.host_rows
                else [None] * k for n, v in arr.items()}
      for n, v in arr.items():
        rows[n][j] = v
      pf_used[j] = e
      rec.useful_prefetches += 1
    rec.prefetch_wait_s += time.perf_counter() - t0
    if rows is None:
      return self.zero_rows, pf_used
    if not self.host_rows:
      rows = {n: jnp.stack([r if r is not None else self.zero_rows[n][0] for r in rs])
              for n, rs in rows.items()}
    return rows, pf_used

  def count_recall(self, l: int, true_ids: np.ndarray, rec):
    pred = rec.layer(l).predicted
    rec.layer(l).true_ids = [int(e) for e in true_ids]
    if pred:
      rec.recall_hits += len(set(pred) & set(int(e) for e in true_ids))
      rec.predicted_calls += len(true_ids)

  def _collect_drained(self):
    """Collects the wasted prefetches whose link time has passed (they hold copies)."""
    keep = []
    for t in self.drain:
      if t.done():
        try:
          t.wait(self.timeout_s)
        except tickets_lib.TransferCancelled:
          pass
      else:
        keep.append(t)
    self.drain = keep

  def cancel_pending(self):
    for pend in self.pending.values():
      for t in pend[1]:
        t.cancel()
    self.pending = {}
    for t in self.drain:
      t.cancel()
    self.drain = []


def stacked_predictors(cfg: ModelConfig, kind: str, predictors: dict | None):
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
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs) if layer_stack.uniform(cfg) else xs


def warm(layers, cfg: ModelConfig, params, states, x, tp, new_kv, zero_x, zero_rows: dict,
         host_rows: bool):
  """Compiles the engine's prefetch steps (`layers`: the engine's LayerDecoder) of every
  MoE layer kind and neighbour on throwaway copies of the resident states (`new_kv(l)`:
  a fresh device KV cache for layer l), in the order a decode step calls them."""
  sp = layers.spec
  copy = lambda l: jax.tree_util.tree_map(jnp.copy, states[l])
  rows_kinds = [zero_rows, jax.device_get(zero_rows)] if host_rows else [zero_rows]
  outs, done, prev = {}, set(), None     # outs: a decision per layer kind (h, moe_in, dec)
  for i in sp.moe_layers:
    nxt, rep = sp.next_layer(i), steps_lib.representative(cfg, i)
    pa = sp.predict_args(i, params)
    step = layers.spec_step(i, prev, sp.predicts(i))
    for rows in (rows_kinds if prev is not None else [None]):
      if (step, id(rows)) in done:
        continue
      done.add((step, id(rows)))
      if prev is None:
        out = step(None, None, params[f"layers_{i}"], x, tp, new_kv(i), copy(i), sp.no_pf,
                   sp.no_pred, np.bool_(False), pa)
      else:
        h, moe_in, dec = outs[steps_lib.representative(cfg, prev)]
        out = step(copy(prev), (params[f"layers_{prev}"], h, moe_in, dec, zero_x, sp.no_pf,
                                rows), params[f"layers_{i}"], None, tp, new_kv(i), copy(i),
                   sp.no_pf, sp.no_pred, np.bool_(False), pa)
      jax.block_until_ready(out)
      outs.setdefault(rep, (out[0], out[1], out[3]))
    fused_next = (layers.fuse_spec and sp.mode.prefetch != "oracle"
                  and steps_lib.fusable(cfg, i))
    prev = i if fused_next else None
    if fused_next or ("moe", rep) in done:
      continue
    done.add(("moe", rep))
    h, moe_in, dec = outs[rep]
    for rows in rows_kinds:
      jax.block_until_ready(layers.pf_steps[i]["moe"](params[f"layers_{i}"], h, moe_in, dec,
                                                      zero_x, copy(i), sp.no_pf, rows))
    if nxt is not None and sp.mode.prefetch == "oracle":
      jax.block_until_ready(pf_steps.oracle_step(cfg, sp.dtype, steps_lib.representative(
          cfg, nxt))(params[f"layers_{nxt}"], x, tp, new_kv(nxt)))
