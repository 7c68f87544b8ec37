"""One MoE layer of the engine's decode step (the engine's module docstring, steps 1-3).

`LayerDecoder` holds what the engine shares with it (the per-layer ResidentStates,
the SlotWriter, the prefetcher, the jitted steps) and runs a layer:

  moe_layer   insert arrived admissions + attention + router + `policy.decide` (with the
              previous MoE layer's moe call in the same dispatch when the two are
              consecutive: `steps.fused_steps`), then the host's part (`serve`); the
              layer's own moe call is returned pending, for the next layer's call or
              `moe_call`
  spec_layer  the same with speculative prefetch on (`prefetch`, `prefetch_steps`): the
              previous MoE layer's moe call, this layer's decision and the next
              layer's prediction in one call
  serve       sync fetches, background admission requests, statistics, HOST experts
  run_from    one `runs.run_fn` call (the layers that need no host work, in one call)
              and the host's part of the layer where it stopped (`serve`, or
              `moe_layer` for admissions due)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np

from moejax.offload import host_experts
from moejax.offload import prefetch_steps as pf_steps_lib
from moejax.offload import runs as runs_lib
from moejax.offload import steps as steps_lib
from moejax.offload.policy import FETCH, HOST
from moejax.offload.stats import TokenRecord


class PendingMoe(NamedTuple):
  """A MoE layer's moe call, decided and served, not yet run."""
  layer: int
  st: object            # the layer's steps.LayerSteps
  p: dict               # the layer's parameters
  h: object
  moe_in: object
  dec: object
  host_out: object


class SpecPending(NamedTuple):
  """A MoE layer's moe call with speculative prefetch, decided and served, not yet run."""
  layer: int
  p: dict
  h: object
  moe_in: object
  dec: object
  host_out: object
  pf_used: np.ndarray   # [K] the prefetched experts it executes (-1: none)
  rows: dict            # their weights {name: [K, ...]}


class LayerDecoder:
  """Runs MoE layers of a decode step on the engine's shared state (see above)."""

  def __init__(self, cfg, states: dict, slots, prefetcher, store, fused: dict, trim_to,
               zero_x, spec=None, pf_steps=None, run=None, steps=None, policy=None,
               fuse_spec: bool = True, straight=None):
    self.steps_of = (steps or []).__getitem__     # layer -> its steps.LayerSteps
    self.cfg, self.states, self.slots, self.prefetcher = cfg, states, slots, prefetcher
    self.store, self.fused, self.trim_to = store, fused, trim_to
    self.zero_x, self.spec, self.pf_steps, self.run = zero_x, spec, pf_steps, run
    self.policy, self.fuse_spec = policy, fuse_spec
    self.straight = straight      # the all-resident run without conds (`runs`), or None
    self.moe_layers = tuple(cfg.moe_layers)

  def run_from(self, params, start: int, pend: PendingMoe | None, x, tp: np.ndarray,
               cache: list, zero_pend, rec: TokenRecord, mark):
    """One `self.run` call from layer `start` (after `pend`, the served MoE layer
    start - 1, if any; `x`: layer start's input otherwise), then the host's part of
    the layer where it stopped.  -> the next-token logits [V] (numpy) when it finished
    the token, else (that layer's PendingMoe, tp on the device, x)."""
    out, straight = self.run_call(params, start, pend, x, tp, cache, zero_pend, mark)
    info, served = self.run_read(out.info, straight, rec, mark)
    kk = self.cfg.top_k
    if info.kind == runs_lib.FINISHED:
      return np.asarray(out.logits)
    j, p = info.layer, params[f"layers_{info.layer}"]
    if served is not None:
      d = steps_lib.unpack_decision(info.packed[j], kk)
      host_out = self.serve(j, d, out.h, out.moe_in, out.dec, rec, mark)
      pm = PendingMoe(j, self.steps_of(j), p, out.h, out.moe_in, out.dec, host_out)
    else:        # admissions due before layer j: inserted with its decision
      pm = self.moe_layer(j, self.steps_of(j), p, out.x, out.tp, cache, rec, mark, None)
    return pm, out.tp, out.x

  def run_call(self, params, start: int, pend: PendingMoe | None, x, tp, cache: list,
               zero_pend, mark):
    """Dispatches one run call (the straight run where it applies: the token's first
    call, nothing queued) and takes its caches and resident states; reads nothing back
    (`run_read`), so the host may go on before the device is done.  -> (out, straight)."""
    stop = runs_lib.stop_mask(self.moe_layers, self.slots.adm.pending)
    j = -1 if pend is None else pend.layer
    args = zero_pend if pend is None else (pend.h, pend.moe_in, pend.dec, pend.host_out)
    mark("run", start)
    straight = self.straight is not None and start == 0 and pend is None and not stop.any()
    if straight:      # metadata stacked over the layers (`runs.StateTable`)
      out = self.straight(params, np.int32(start), np.int32(j), runs_lib.straight_pend(args),
                          x, tp, cache,
                          self.states.stacked(), self.states.buffers(), stop)
      self.states.set_stacked(out.metas)
    else:
      metas, bufs = {}, {}
      for l in self.moe_layers:
        metas[l], bufs[l] = runs_lib.split_state(self.states[l])
      out = self.run(params, np.int32(start), np.int32(j), args, x, tp, cache, metas, bufs,
                     stop)
      runs_lib.restate(self.states, out.metas)
    cache[:] = out.caches
    return out, straight

  def run_read(self, info, straight: bool, rec: TokenRecord, mark):
    """The host's read of a run call's `info` (on the device, or already read back):
    counts its decisions into `rec`. -> (RunInfo, the layer the host serves next or
    None)."""
    cfg, kk = self.cfg, self.cfg.top_k
    slots = next(iter(self.states.values())).slot_expert.shape[0]
    info = runs_lib.unpack_info(np.asarray(info), self.moe_layers, kk, cfg.num_experts,
                                slots)
    mark("run_done", info.layer)
    if straight and info.kind != runs_lib.FINISHED:
      raise RuntimeError(f"moejax internal error: MoE layer {info.layer} needed the host in an "
                         f"engine whose every expert is resident (straight layer run)")
    served = info.layer if info.kind == runs_lib.AFTER_DECISION else None
    if info.decided:
      ints = np.stack([info.packed[l][:3 * kk] for l in info.decided]).astype(np.int32)
      gates = np.stack([info.packed[l][4 * kk:5 * kk] for l in info.decided])
    for m, l in enumerate(info.decided):
      self.slots.collect_carried(l, rec)
      if l != served:     # `serve` counts the decision it serves
        rec.count_decision(l, ints[m, :kk], ints[m, kk:2 * kk], ints[m, 2 * kk:], gates[m])
    if self.trim_to is not None:
      self.slots.evicted.extend((l, info.evicted[l]) for l in info.moe_ran)
    return info, served

  def moe_call(self, pend: PendingMoe, mark, trace: bool):
    """Runs a pending moe call alone (no next MoE layer to fuse it with); -> x."""
    i = pend.layer
    mark("moe", i)
    x, self.states[i], ev = pend.st.moe(pend.p, pend.h, pend.moe_in, pend.dec, pend.host_out,
                                        self.states[i])
    if self.trim_to is not None:
      self.slots.evicted.append((i, ev))
    if trace:
      jax.block_until_ready(x)
    mark("moe_done", i)
    return x

  def moe_layer(self, i: int, st, p, x, tp, cache: dict, rec: TokenRecord, mark,
                pend: PendingMoe | None) -> PendingMoe:
    """One MoE layer of a decode step (module docstring, steps 1-3); `pend`: the
    previous MoE layer's moe call, run in the same call as this layer's decision
    (`steps.fused_steps`).  Returns this layer's moe call, pending."""
    if pend is not None:   # the previous layer's moe call runs inside this layer's call
      mark("moe", pend.layer)
      mark("moe_done", pend.layer)
    mark("attend", i)
    self.slots.collect_carried(i, rec)               # inserted ahead, due now
    fused = self.slots.admit(i, carry=False, rec=rec)
    if pend is not None:
      j = pend.layer
      fs, args = self.fused[j], (pend.p, pend.h, pend.moe_in, pend.dec, pend.host_out,
                                 self.states[j], p, tp, cache[i], self.states[i])
      if fused is None:
        h, moe_in, cache[i], dec, packed, self.states[j], ev = fs.moe_attend_decide(*args)
      else:
        (h, moe_in, cache[i], dec, packed, self.states[j], ev, self.states[i],
         ev_i) = fs.moe_insert_attend_decide(*args, *fused)
        self.slots.evicted.append((i, ev_i))
      if self.trim_to is not None:
        self.slots.evicted.append((j, ev))
    elif fused is None:
      h, moe_in, cache[i], dec, packed = st.attend_decide(p, x, tp, cache[i], self.states[i])
    else:
      h, moe_in, cache[i], dec, packed, self.states[i], ev = st.insert_attend_decide(
          p, x, tp, cache[i], self.states[i], *fused)
      self.slots.evicted.append((i, ev))
    d = steps_lib.unpack_decision(np.asarray(packed), self.cfg.top_k)
    mark("decided", i)
    host_out = self.serve(i, d, h, moe_in, dec, rec, mark)
    return PendingMoe(i, st, p, h, moe_in, dec, host_out)

  def spec_layer(self, i: int, p, x, tp, cache: dict, params, rec: TokenRecord, mark,
                 pend: SpecPending | None, trace: bool):
    """One MoE layer with speculative prefetch on (`prefetch` module, steps 1-3): the
    pending moe call of the MoE layer before it (`pend`), this layer's attention and
    decision and the next MoE layer's prediction in one call (`decide_steps`), then the
    host's part.  -> (x, None) when this layer's moe call ran (the last MoE layer before
    a dense layer or the head, `fuse` off, the `oracle` check), else (None, its
    moe call pending)."""
    kk, sp = self.cfg.top_k, self.spec
    mark("attend", i)
    self.slots.collect_carried(i, rec)
    fused = self.slots.admit(i, carry=False, rec=rec)
    if fused is not None:
      self.states[i], ev = self.steps_of(i).insert(self.states[i], *fused)
      self.slots.evicted.append((i, ev))
    pf_ids, pred, has_pred, pf_tickets = sp.take(i, rec)
    predicting = sp.predicts(i)
    step = self.spec_step(i, pend.layer if pend is not None else None, predicting)
    pa = sp.predict_args(i, params)
    prev_state = moe_args = None
    if pend is not None:       # the previous MoE layer's experts run inside this call
      mark("moe_done", pend.layer)
      prev_state = self.states[pend.layer]
      moe_args = (pend.p, pend.h, pend.moe_in, pend.dec, pend.host_out, pend.pf_used, pend.rows)
    h, moe_in, cache[i], dec, packed, true_logits, pred_next, prev_state, ev = step(
        prev_state, moe_args, p, x if pend is None else None, tp, cache[i], self.states[i],
        pf_ids, pred, has_pred, pa)
    if pend is not None:
      self.states[pend.layer] = prev_state
      self.slots.evicted.append((pend.layer, ev))
    packed = np.asarray(packed)
    n = packed.shape[0] - kk * (2 if predicting else 1)
    d = steps_lib.unpack_decision(packed[:n], kk)
    true_ids = packed[n:n + kk].astype(np.int32)
    sp.count_recall(i, true_ids, rec)
    sp.remember(i, true_logits, true_ids)
    mark("decided", i)
    host_out = self.serve(i, d, h, moe_in, dec, rec, mark,
                          (pred_next, packed[n + kk:].astype(np.int32)) if predicting else None)
    mark("moe", i)
    pf_rows, pf_used = sp.rows(i, pf_ids, pf_tickets, d.exec_ids, rec)
    pm = SpecPending(i, p, h, moe_in, dec, host_out, pf_used, pf_rows)
    if self.fuse_spec and sp.mode.prefetch != "oracle" and steps_lib.fusable(self.cfg, i):
      return None, pm
    x = self.spec_moe_call(pm, mark, trace)
    sp.oracle_next(i, params, x, tp, cache, rec)
    return x, None

  def spec_step(self, i: int, prev: int | None, predicting: bool):
    """Layer i's `prefetch_steps.decide_steps` call (kinds by representative layer)."""
    cfg, sp, first = self.cfg, self.spec, self.moe_layers[0]
    rep = steps_lib.representative
    nxt = sp.next_layer(i) if predicting else None
    return pf_steps_lib.decide_steps(
        cfg, sp.dtype, rep(cfg, i), i == first,
        (rep(cfg, prev), prev == first) if prev is not None else None,
        rep(cfg, nxt) if nxt is not None else None, self.policy.decision, self.policy.cache,
        sp.mode, self.trim_to, predicting and sp.estimators.get(i) is not None)

  def spec_moe_call(self, pend: SpecPending, mark, trace: bool):
    """Runs a pending speculative moe call alone; -> x."""
    i = pend.layer
    x, self.states[i], ev = self.pf_steps[i]["moe"](pend.p, pend.h, pend.moe_in, pend.dec,
                                                    pend.host_out, self.states[i],
                                                    pend.pf_used, pend.rows)
    self.slots.evicted.append((i, ev))
    if trace:
      jax.block_until_ready(x)
    mark("moe_done", i)
    return x

  def serve(self, i: int, d, h, moe_in, dec, rec: TokenRecord, mark, pred=None):
    """The host's part of a MoE layer after its decision: the sync fetches (copied,
    inserted, waited for), the next layer's prefetch requests (prefetch on; `pred`: the
    prediction made in the layer's call), background admissions, the statistics, and
    the HOST experts; -> the host experts' output."""
    fetch = [int(e) for e in d.ids[d.action == FETCH]]
    if fetch:
      mark("fetch", i)
      pending = self.slots.fetch(self.prefetcher, i, fetch, d.exec_ids)
    if self.spec is not None:         # behind the sync fetches
      self.spec.predict_next(i, pred, rec)
    if d.admit.any():          # queued behind the sync fetches: they never delay them
      kk = self.cfg.top_k
      adm_ids = [int(e) for e in np.flatnonzero(d.admit)]
      self.slots.request(i, self.prefetcher.request_many(
          i, adm_ids, "background", pad_to=self.slots.rows(min(len(adm_ids), kk))))
      rec.admissions += len(adm_ids)
      rec.layer(i).admissions = adm_ids
    rec.count_decision(i, d.action, d.ids, d.exec_ids, d.gates)
    rec.fetches += len(fetch)
    if fetch:
      rec.layer(i).fetched = fetch
      self.slots.finish_fetch(i, pending, rec, mark)
    host_mask = d.action == HOST
    if not host_mask.any():
      return self.zero_x
    return host_experts.layer_out(h, moe_in, d.ids[host_mask],
                                  d.weights[host_mask], functools.partial(self.store.get, i),
                                  rec)
