"""Writing experts into the slot buffers: fetched rows and background admissions.

`SlotWriter` owns the engine's admission queue (`admissions.Admissions`) and the
evicted-id arrays of the token in flight, and updates the engine's per-layer
`ResidentState`s (a dict it shares with the engine) through the jitted insert
steps.  Admissions are inserted before their layer's decision at the next token
(`admit`, fused with the decision by the engine) or earlier, ahead of their token,
while another layer's fetch crosses the link (`admit_arrived`); either way their
statistics count at the token and layer where they logically take effect.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from moejax.offload import admissions as adm_lib
from moejax.offload import steps as steps_lib
from moejax.offload import tickets as tickets_lib
from moejax.offload.stats import TokenRecord


class SlotWriter:
  """Inserts into `states` (shared with the engine) with the layers' `steps`."""

  def __init__(self, states: dict, steps: list, moe_layers, top_k: int, num_experts: int,
               zero_rows: dict, timeout_s: float):
    self.states, self.steps, self.moe_layers = states, steps, tuple(moe_layers)
    self.top_k, self.num_experts = top_k, num_experts
    self.zero_rows, self.timeout_s = zero_rows, timeout_s
    self.row_buckets = tuple(sorted({min(2, top_k), top_k}))
    self.adm = adm_lib.init(self.moe_layers)
    self.insert_s = float("inf")        # one insert's cost: measured by warmup, then as run
    self.evicted: list[tuple[int, object]] = []   # the token's (layer, evicted ids array)

  def request(self, l: int, tickets):
    """Queues layer l's new background tickets (inserted at the next token)."""
    self.adm = adm_lib.request(self.adm, l, tickets)

  def admitting(self, l: int) -> set[int]:
    """The experts of layer l whose admission is queued (inserted before its decision)."""
    return {t.key[1] for t in self.adm.pending[l]}

  def collect_carried(self, l: int, rec: TokenRecord):
    """Counts in `rec` what was inserted ahead of this token for layer l."""
    self.adm, carried = adm_lib.collect(self.adm, l)
    if not carried.admitted and not carried.evicted:
      return
    rec.layer(l).admitted.extend(carried.admitted)
    self.evicted.extend((l, e) for e in carried.evicted)

  def insert_packed(self, l: int, ins: np.ndarray, rows):
    """One jitted insert of a `steps.pack_insert` array and its rows."""
    self.states[l], ev = self.steps[l].insert(self.states[l], ins, rows)
    self.evicted.append((l, ev))

  def attribute_evictions(self, rec: TokenRecord):
    """Moves the token's evicted ids into its per-layer records."""
    for l, ev in self.evicted:
      rec.layer(l).evicted.extend(int(e) for e in np.asarray(ev) if e >= 0)
    self.evicted = []

  def cancel_pending(self):
    for t in adm_lib.all_tickets(self.adm):
      t.cancel()
    self.adm = adm_lib.init(self.moe_layers)

  def rows(self, n: int) -> int:
    """The row bucket for inserting n <= K experts: 2 or K (one compile each)."""
    return min(b for b in self.row_buckets if b >= n)

  def insert(self, l: int, ids, rows, in_use_E: np.ndarray):
    """Inserts ids (stacked rows [>= len(ids), ...]) K at a time; the evicted arrays."""
    k, evicted = self.top_k, []
    for i in range(0, len(ids), k):
      part = list(ids[i:i + k])
      r = {n: v[i:i + k] for n, v in rows.items()}
      if len(part) < k:
        r = {n: jnp.concatenate([v, self.zero_rows[n][:k - v.shape[0]]]) for n, v in r.items()}
      ins = steps_lib.pack_insert(part, in_use_E, k)
      self.states[l], ev = self.steps[l].insert(self.states[l], ins, r)
      evicted.append(ev)
      in_use_E = in_use_E.copy()
      in_use_E[part] = True
    return evicted

  def admit(self, l: int, carry: bool, rec: TokenRecord | None = None):
    """Takes layer l's pending admissions and inserts them, waiting for any not
    arrived: all but the last <= K in chunks of K, the last ones in one insert of the
    smallest row bucket.  carry=True: ahead of their logical token (stats carried to
    it), all inserted here; else counted in `rec` and the last ones returned as a
    packed (ins, rows) for the fused insert before the layer's decision (None:
    nothing)."""
    self.adm, ready = adm_lib.take(self.adm, l)
    if not ready:
      return None
    t0 = time.perf_counter()
    tickets_lib.wait_all(ready, timeout=self.timeout_s)
    ids = [t.key[1] for t in ready]
    split = (len(ids) - 1) // self.top_k * self.top_k
    in_use = np.zeros(self.num_experts, bool)
    evicted = self.insert(l, ids[:split], tickets_lib.stacked(ready[:split]), in_use) \
        if split else []
    in_use[ids[:split]] = True                         # not evicted for the rest
    r = self.rows(len(ids) - split)
    last = (steps_lib.pack_insert(ids[split:], in_use, r), tickets_lib.stacked(ready[split:], r))
    if carry:
      self.states[l], ev = self.steps[l].insert(self.states[l], *last)
      self.adm = adm_lib.carry(self.adm, l, ids, evicted + [ev])
      return None
    rec.admission_wait_s += time.perf_counter() - t0
    rec.layer(l).admitted.extend(ids)
    self.evicted.extend((l, e) for e in evicted)
    return last

  def fetch(self, prefetcher, l: int, ids: list[int], exec_ids: np.ndarray) -> tuple:
    """Requests layer l's FETCH experts at once (sync priority); -> the pending fetch
    for `finish_fetch`.  Experts the layer executes are never evicted for them."""
    r = self.rows(len(ids))
    tickets, rows = prefetcher.fetch(l, ids, pad_to=r)
    in_use = np.zeros(self.num_experts, bool)
    in_use[exec_ids[exec_ids >= 0]] = True
    return tickets, rows, steps_lib.pack_insert(ids, in_use, r), r

  def finish_fetch(self, l: int, pending: tuple, rec: TokenRecord, mark):
    """Inserts the fetched rows while their link time elapses (with other layers'
    arrived admissions), then waits for the link; counts the wait in `rec`."""
    tickets, rows, ins, r = pending
    if rows is not None:       # placed while the link time elapses
      self.insert_packed(l, ins, rows)
      self.admit_arrived(after=l, deadline=max(t.finished_s for t in tickets))
    tw = time.perf_counter()
    arrived = tickets_lib.wait_stacked(tickets, r, timeout=self.timeout_s)
    rec.wait_s += time.perf_counter() - tw
    mark("arrived", l)
    rec.fetch_bytes += sum(tk.nbytes for tk in tickets)
    if rows is None:           # some came from a background transfer: insert them now
      self.insert_packed(l, ins, arrived)

  def admit_arrived(self, after: int, deadline: float):
    """While a fetch of layer `after` crosses the link (until `deadline`), inserts
    other layers' arrived admissions ahead of their logical token (later layers
    first), as long as one insert still fits before the deadline."""
    order = [l for l in self.moe_layers if l > after] + [l for l in self.moe_layers if l < after]
    for l in order:
      if time.perf_counter() + self.insert_s > deadline:
        return
      if adm_lib.arrived(self.adm, l):
        t0 = time.perf_counter()
        self.admit(l, carry=True)
        self.insert_s = 0.5 * self.insert_s + 0.5 * (time.perf_counter() - t0)
