"""One decode step of the engine: layer runs where they pay, per-layer calls elsewhere.

At each point of a token (its start, or after the host served a MoE layer) the
next stretch of layers goes either to one `runs` call (every layer up to the next
that needs the host, in one call) or to the per-layer steps (`LayerDecoder`: one
call per MoE layer, fused with the previous layer's moe call).  Both are exact
(bit-identical outputs and records), so the choice only moves time.  A run call
has a fixed cost of several per-layer calls on a CPU backend (its conds pass every
layer's state through), so a run is taken only when it is expected to cover at
least `min_run` MoE layers or to finish the token: the expected stop is the first
MoE layer with admissions due, or that needed the host at the previous token.

Deferred steps (`decode_deferred`): in an engine whose every expert is resident the
token is one straight run call that never needs the host, so nothing the host does
depends on its result.  Such a step takes its token as a device array, returns the
logits on the device without waiting, and leaves the call's packed decisions on the
device (`unread`); `read_deferred` copies the oldest back to the host (long computed by
then: no wait) and keeps them packed (`read`, ~6 KB a token on the demo model);
`build_records` turns them into TokenRecords when someone asks for the records.  The
records are statistics only: the policy's state lives on the device, so nothing the next
token does waits for them.  Records, resident states and logits equal a plain step's.
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.offload import runs as runs_lib
from moejax.offload.policy import HOST
from moejax.offload.stats import TokenRecord


@jax.jit
def _token_position(token, position):
  """[token, position] int32 for a run call, in one dispatch: built eagerly (asarray,
  reshape, concatenate) it cost ~0.24 ms a token on the CPU backend, a sixth of the
  demo model's step."""
  return jnp.stack([jnp.asarray(token, jnp.int32).reshape(()), position])


class TokenDecoder:
  """A decode step's layers and head on the engine's state (module docstring)."""

  def __init__(self, cfg, layers, steps: list, model_steps, fused: dict, min_run: int = 3):
    self.cfg, self.layers, self.steps, self.model = cfg, layers, steps, model_steps
    self.fused, self.min_run = fused, min_run
    self.moe_layers = tuple(cfg.moe_layers)
    self.host_prev = {l: False for l in self.moe_layers}   # needed the host last token
    self.unread = collections.deque()   # deferred steps: (run info on the device, rec, t0)
    self.read = []                      # read back, record not built: (info, rec, wall_s)

  def _take_run(self, start: int) -> bool:
    """A run from layer `start`: its expected stop is far enough, or the token's end."""
    pending = self.layers.slots.adm.pending
    covered = 0
    for l in self.moe_layers:
      if l < start:
        continue
      if pending[l]:
        return covered >= self.min_run
      covered += 1
      if self.host_prev[l]:
        return covered >= self.min_run
    return True

  def decode(self, params, tp_np: np.ndarray, cache: list, no_pend, rec: TokenRecord, mark,
             trace: bool) -> np.ndarray:
    """The token [token, position] through every layer and the head; -> logits [V]."""
    cfg, lay = self.cfg, self.layers
    x0, zero_pend = no_pend if no_pend is not None else (None, None)   # None: no runs
    x, tp, pend, i = None, None, None, 0       # x None: not embedded yet
    while True:
      if lay.run is not None and self._take_run(i):
        out = lay.run_from(params, i, pend, x if x is not None else x0, tp_np, cache,
                           zero_pend, rec, mark)
        if isinstance(out, np.ndarray):
          break
        pend, tp, x = out
        i = pend.layer + 1
        continue
      if i >= cfg.num_layers:
        if pend is not None:
          x = lay.moe_call(pend, mark, trace)
        mark("head", -1)
        out = np.asarray(self.model.head_decode(params, x))
        break
      if x is None and pend is None:
        x, tp = self.model.embed_decode(params, tp_np)
      st, p = self.steps[i], params[f"layers_{i}"]
      if pend is not None and (not cfg.sparse_layers[i] or self.fused[pend.layer] is None):
        x, pend = lay.moe_call(pend, mark, trace), None
      if not cfg.sparse_layers[i]:
        mark("dense", i)
        x, cache[i] = st.dense_decode(p, x, tp, cache[i])
      else:
        pend = lay.moe_layer(i, st, p, x, tp, cache, rec, mark, pend)
      i += 1
    for l in self.moe_layers:
      r = rec.layers.get(l)
      self.host_prev[l] = bool(r is not None and (r.fetched or r.admissions
                                                  or HOST in r.actions))
    return out

  def can_defer(self) -> bool:
    """Whether the next token is one straight run (every expert resident, nothing queued)."""
    return (self.layers.straight is not None
            and not runs_lib.stop_mask(self.moe_layers, self.layers.slots.adm.pending).any())

  def decode_deferred(self, params, token, end_index: int, cache: list, no_pend,
                      rec: TokenRecord, t0: float):
    """One straight run for `token` (an int or a device int32 scalar) at `end_index`;
    -> the logits [V] on the device, not waited for.  Its record is read later."""
    x0, zero_pend = no_pend
    tp = _token_position(token, np.int32(end_index))
    out, straight = self.layers.run_call(params, 0, None, x0, tp, cache, zero_pend,
                                         lambda ev, l: None)
    if not straight:
      raise RuntimeError("moejax internal error: a deferred step needs the straight run")
    self.unread.append((out.info, rec, t0))
    return out.logits

  def read_deferred(self, keep: int = 0):
    """Copies deferred steps' packed decisions to the host, oldest first, until `keep`
    remain on the device.  A step's wall time is the time from its dispatch to the next
    step's dispatch (the device works asynchronously), or, for the newest, to the moment
    its result was read."""
    while len(self.unread) > keep:
      info, rec, t0 = self.unread.popleft()
      info = np.asarray(info)
      t_end = self.unread[0][2] if self.unread else time.perf_counter()
      self.read.append((info, rec, t_end - t0))

  def build_records(self, finish):
    """Every deferred step's record, in order: `finish(rec, wall_s)` completes each."""
    self.read_deferred()
    for info, rec, wall in self.read:
      self.layers.run_read(info, True, rec, lambda ev, l: None)
      finish(rec, wall)
    self.read.clear()
