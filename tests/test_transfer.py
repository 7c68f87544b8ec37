"""The prefetch thread: owned copies, link timing, dedup, priorities, cancel, errors.

Every wait has a timeout so a bug cannot hang CI.
"""

import threading
import time

import jax
import numpy as np
import pytest

from moejax.offload.link import NATIVE, parse_link
from moejax.offload.copies import owned_device_put, shares_buffer, stacked_device_put
from moejax.offload.tickets import (TransferCancelled, TransferError, TransferTimeout,
                                    wait_stacked)
from moejax.offload.transfer import Prefetcher
from moejax.store import ExpertStore

D, I, E = 32, 16, 8
EXPERT_BYTES = (2 * I * D + D * I) * 4  # 6,144 B in f32
T = 5.0  # seconds: generous timeout for every blocking call


def aligned(a, align=64):
  """A copy of `a` in a buffer aligned to `align` bytes: XLA CPU's device_put wraps
  such numpy buffers instead of copying them, the hazard the prefetcher guards."""
  raw = np.empty(a.nbytes + align, np.uint8)
  off = -raw.ctypes.data % align
  out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
  out[...] = a
  return out


def make_store(seed=0):
  rng = np.random.default_rng(seed)
  layer = lambda: {"gate_up": aligned(rng.standard_normal((E, 2 * I, D), dtype=np.float32)),
                   "down": aligned(rng.standard_normal((E, D, I), dtype=np.float32))}
  return ExpertStore.from_stacked([None, layer(), layer()])


class GatedStore:
  """Records get() order; blocks `block` keys until `gate` is set; raises for `fail` keys."""

  def __init__(self, store, block=(), fail=None):
    self.store, self.block, self.fail = store, set(block), dict(fail or {})
    self.gate = threading.Event()
    self.calls = []

  def get(self, layer, expert):
    self.calls.append((layer, expert))
    if (layer, expert) in self.block:
      assert self.gate.wait(T), "test gate never opened"
    if (layer, expert) in self.fail:
      raise self.fail[(layer, expert)]
    return self.store.get(layer, expert)


def wait_for(cond, timeout=T):
  end = time.perf_counter() + timeout
  while not cond():
    if time.perf_counter() > end:
      raise AssertionError("condition not reached in time")
    time.sleep(1e-3)


# ---------------------------------------------------------------- owned copies
def test_owned_device_put_never_aliases_numpy_or_memmap(tmp_path):
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  x = aligned(np.arange(4096, dtype=np.float32).reshape(64, 64))
  # the hazard on this backend: a plain device_put wraps the numpy buffer
  assert shares_buffer(jax.device_put(x, sharding), x)
  y = owned_device_put(x, sharding)
  assert not shares_buffer(y, x)
  x[0, 0] = -1.0
  assert float(y[0, 0]) == 0.0
  mm = np.memmap(tmp_path / "a.bin", dtype=np.float32, mode="w+", shape=(64, 64))
  mm[:] = 3.0
  z = owned_device_put(mm, sharding)
  assert not shares_buffer(z, mm)
  mm[:] = 4.0
  assert float(z.sum()) == 3.0 * 4096


def test_wait_returns_owned_device_copies_of_the_expert():
  store = make_store()
  want = {k: v.copy() for k, v in store.get(1, 3).items()}
  with Prefetcher(store, NATIVE) as pf:
    got = pf.request(1, 3).wait(T)
  assert set(got) == {"gate_up", "down"}
  for k, v in got.items():
    assert isinstance(v, jax.Array) and v.sharding.memory_kind == "device"
    assert not shares_buffer(v, store.get(1, 3)[k])
    np.testing.assert_array_equal(np.asarray(v), want[k])
  store.layers[1].stacked["gate_up"][3] += 1.0  # mutate the host source afterwards
  np.testing.assert_array_equal(np.asarray(got["gate_up"]), want["gate_up"])


def test_pinned_host_target_memory_kind():
  with Prefetcher(make_store(), NATIVE, memory_kind="pinned_host") as pf:
    got = pf.request(2, 1).wait(T)
  assert got["down"].sharding.memory_kind == "pinned_host"
  with pytest.raises(ValueError, match="memory kind 'hbm'"):
    Prefetcher(make_store(), NATIVE, memory_kind="hbm")


# ---------------------------------------------------------------- link timing
def test_emulated_transfer_is_not_done_before_bytes_over_bandwidth_plus_latency():
  link = parse_link("1MB/s,30ms")
  expected = EXPERT_BYTES / 1e6 + 30e-3  # 36.1 ms
  with Prefetcher(make_store(), link) as pf:
    t0 = time.perf_counter()
    t = pf.request(1, 0)
    while not t.done():
      time.sleep(2e-4)
      assert time.perf_counter() - t0 < T
    first_done = time.perf_counter() - t0
    assert first_done >= expected
    assert first_done <= expected + 0.25  # and done shortly after
    assert t.nbytes == EXPERT_BYTES
    assert t.finished_s - t.started_s >= expected - 1e-9  # float rounding only
    t1 = time.perf_counter()
    pf.request(1, 1).wait(T)
    assert time.perf_counter() - t1 >= expected


def test_transfers_serialise_on_the_link():
  link = parse_link("1MB/s,20ms")
  per = link.transfer_time(EXPERT_BYTES)
  with Prefetcher(make_store(), link) as pf:
    ts = [pf.request(1, e) for e in range(3)]
    for t in ts:
      t.wait(T)
  for a, b in zip(ts, ts[1:]):
    assert b.started_s >= a.finished_s
  assert ts[-1].finished_s - ts[0].requested_s >= 3 * per - 1e-9  # float rounding only
  assert pf.stats()["link_busy_s"] >= 3 * per - 1e-5  # counted in whole microseconds


def test_compute_runs_while_the_link_is_busy():
  link = parse_link("1MB/s,40ms")
  expected = link.transfer_time(EXPERT_BYTES)
  with Prefetcher(make_store(), link) as pf:
    t = pf.request(2, 5)
    a = np.ones((64, 64), np.float32)
    end = time.perf_counter() + expected + 0.05
    while time.perf_counter() < end:  # the caller's real compute
      a = np.tanh(a @ a * 1e-3)
    t.wait(T)
  assert t.wait_s < 0.02  # arrived during compute: (almost) no stall


# ------------------------------------------------------ queue: dedup, priority
def test_duplicate_requests_share_one_ticket_and_one_transfer():
  gs = GatedStore(make_store(), block=[(1, 0)])
  with Prefetcher(gs, NATIVE) as pf:
    blocker = pf.request(1, 0, "background")
    wait_for(lambda: gs.calls == [(1, 0)])
    a = pf.request(1, 5, "background")
    assert pf.request(1, 5, "background") is a
    assert pf.request(1, 5, "sync") is a and a.priority == "sync"  # upgraded
    gs.gate.set()
    a.wait(T)
    blocker.wait(T)
    s = pf.stats()
    assert (s["requests"], s["deduplicated"], s["upgraded"]) == (4, 2, 1)
    assert s["transfers"] == 2 and s["bytes"] == 2 * EXPERT_BYTES
    assert gs.calls.count((1, 5)) == 1
    assert pf.pending() == 0  # both collected by wait()
    b = pf.request(1, 5)  # collected: asking again is a new transfer
    assert b is not a
    b.wait(T)
    assert pf.stats()["transfers"] == 3


def test_sync_requests_are_served_before_queued_background_ones():
  gs = GatedStore(make_store(), block=[(1, 0)])
  with Prefetcher(gs, NATIVE) as pf:
    first = pf.request(1, 0, "background")
    wait_for(lambda: gs.calls == [(1, 0)])  # on the link
    bg = [pf.request(1, 1, "background"), pf.request(1, 2, "background")]
    sy = [pf.request(2, 3, "sync"), pf.request(2, 4, "sync")]
    gs.gate.set()
    for t in [first] + bg + sy:
      t.wait(T)
  assert gs.calls == [(1, 0), (2, 3), (2, 4), (1, 1), (1, 2)]
  assert sy[1].finished_s <= bg[0].started_s


def sync_behind_background(link, chunks):
  """A sync request made while a background transfer is on the link: (bg, sync)."""
  with Prefetcher(make_store(), link, background_chunks=chunks) as pf:
    bg = pf.request(1, 0, "background")
    wait_for(lambda: bg.started_s is not None)
    s = pf.request(2, 0)
    s.wait(T)
    bg.wait(T)
  return bg, s


def test_a_sync_request_does_not_preempt_the_transfer_on_the_link():
  link = parse_link("1MB/s,20ms")
  bg, s = sync_behind_background(link, chunks=1)
  assert s.started_s >= bg.finished_s
  assert s.finished_s - bg.started_s >= 2 * link.transfer_time(EXPERT_BYTES) - 1e-9


def test_a_sync_request_overtakes_a_background_transfer_at_a_piece_boundary():
  link = parse_link("1MB/s,20ms")
  total = link.transfer_time(EXPERT_BYTES)
  piece = total / 4
  bg, s = sync_behind_background(link, chunks=4)
  done = s.started_s - bg.started_s            # background link time before the overtake
  assert 0 < done < total
  assert abs(done / piece - round(done / piece)) < 1e-6       # on a piece boundary
  assert s.finished_s - s.started_s >= total - 1e-9           # the sync transfer is whole
  assert bg.finished_s >= s.finished_s + (total - done) - 1e-9  # the rest comes after it
  with pytest.raises(ValueError, match="background_chunks"):
    Prefetcher(make_store(), link, background_chunks=0)


def test_arrived_background_request_is_deduplicated_until_collected():
  with Prefetcher(make_store(), parse_link("1MB/s,5ms")) as pf:
    t = pf.request(2, 2, "background")
    assert not t.done()  # link time not elapsed yet
    wait_for(t.done)
    assert pf.request(2, 2, "background") is t  # arrived, not collected: no new transfer
    assert pf.stats()["transfers"] == 1 and pf.pending() == 1
    np.testing.assert_array_equal(np.asarray(t.wait(0.0)["down"]), make_store().get(2, 2)["down"])
    assert pf.pending() == 0 and pf.held_bytes() == 0     # collected: nothing kept
    assert pf.request(2, 2, "background") is not t


def test_sync_request_for_an_arrived_background_ticket_takes_it_over():
  with Prefetcher(make_store(), NATIVE) as pf:
    t = pf.request(1, 7, "background")
    wait_for(t.done)
    assert pf.request(1, 7, "sync") is t
    assert t.priority == "sync"  # the sync caller owns it now
    t.wait(T)
    assert pf.stats()["transfers"] == 1


# ------------------------------------------------------------------ cancelling
def test_cancel_queued_ticket():
  gs = GatedStore(make_store(), block=[(1, 0)])
  with Prefetcher(gs, NATIVE) as pf:
    inflight = pf.request(1, 0)
    wait_for(lambda: gs.calls == [(1, 0)])
    a, b = pf.request(1, 1), pf.request(1, 2)
    assert a.cancel() and a.cancelled() and a.done()
    assert not a.cancel()
    assert not inflight.cancel()  # already on the link
    gs.gate.set()
    with pytest.raises(TransferCancelled):
      a.wait(T)
    b.wait(T)
    inflight.wait(T)
    assert (1, 1) not in gs.calls
    assert pf.stats()["cancelled"] == 1
    again = pf.request(1, 1)
    assert again is not a
    again.wait(T)


def test_wait_timeout_raises_instead_of_hanging():
  gs = GatedStore(make_store(), block=[(1, 0)])
  with Prefetcher(gs, NATIVE) as pf:
    t = pf.request(1, 0)
    t0 = time.perf_counter()
    with pytest.raises(TransferTimeout, match="layer 1 expert 0"):
      t.wait(timeout=0.05)
    assert time.perf_counter() - t0 < 1.0
    assert issubclass(TransferTimeout, TransferError)
    gs.gate.set()
    t.wait(T)


def test_close_cancels_pending_and_joins_the_thread():
  gs = GatedStore(make_store(), block=[(1, 0)])
  pf = Prefetcher(gs, NATIVE)
  inflight = pf.request(1, 0)
  wait_for(lambda: gs.calls == [(1, 0)])
  queued = pf.request(1, 1)
  threading.Timer(0.1, gs.gate.set).start()
  pf.close()
  assert not pf.alive
  with pytest.raises(TransferCancelled):
    queued.wait(T)
  inflight.wait(T)  # the transfer on the link completes
  with pytest.raises(RuntimeError, match="closed"):
    pf.request(1, 2)
  pf.close()  # idempotent


def test_context_manager_does_not_mask_the_callers_exception():
  with pytest.raises(KeyError):
    with Prefetcher(make_store(), NATIVE) as pf:
      pf.request(1, 1)
      raise KeyError("caller bug")
  assert not pf.alive


def test_bad_priority():
  with Prefetcher(make_store(), NATIVE) as pf:
    with pytest.raises(ValueError, match="priority"):
      pf.request(1, 1, "urgent")


# ----------------------------------------------------------------------- errors
def test_thread_error_surfaces_in_wait_and_stops_cleanly():
  gs = GatedStore(make_store(), block=[(1, 2)], fail={(1, 2): OSError("disk gone")})
  with Prefetcher(gs, NATIVE) as pf:
    bad = pf.request(1, 2)
    wait_for(lambda: gs.calls == [(1, 2)])
    behind = pf.request(1, 3)  # queued behind the failing transfer
    gs.gate.set()
    with pytest.raises(TransferError, match="disk gone") as e:
      bad.wait(T)
    assert isinstance(e.value.__cause__, OSError)
    with pytest.raises(TransferError):  # no hang for the queued ticket
      behind.wait(T)
    wait_for(lambda: not pf.alive)
    with pytest.raises(TransferError):
      pf.request(1, 4)
  # leaving the block: close() does not raise again, the error was reported
  assert not pf.alive and (1, 3) not in gs.calls


def test_unobserved_thread_error_is_raised_by_close():
  pf = Prefetcher(GatedStore(make_store(), fail={(2, 6): ValueError("bad tensor")}), NATIVE)
  pf.request(2, 6, "background")
  wait_for(lambda: not pf.alive)
  with pytest.raises(TransferError, match="bad tensor"):
    pf.close()
  assert not pf.alive
  pf.close()  # reported once


def test_thread_error_surfaces_at_the_next_request():
  pf = Prefetcher(GatedStore(make_store(), fail={(1, 1): RuntimeError("boom")}), NATIVE)
  pf.request(1, 1, "background")
  wait_for(lambda: not pf.alive)
  with pytest.raises(TransferError, match="boom"):
    pf.request(1, 2)
  pf.close()  # already reported: no second raise


# ---------------------------------------------------------------- groups (request_many)
def test_request_many_copies_a_group_once_stacked_and_padded():
  store = make_store()
  gs = GatedStore(store, block=[(1, 0)])
  with Prefetcher(gs, parse_link("100MB/s")) as pf:
    first = pf.request(1, 0)                     # holds the thread while the group queues
    wait_for(lambda: gs.calls == [(1, 0)])
    group = pf.request_many(1, [5, 2, 7], "sync", pad_to=4)
    gs.gate.set()
    first.wait(T)
    rows = wait_stacked(group, 4)
    # one copy for the whole group: the arrays the thread put, no device work
    assert all(t._arrays is rows for t in group)
    assert [t._row for t in group] == [0, 1, 2]
    assert pf.stats()["transfers"] == 4
    # the link timing stays per ticket: one after another
    for a, b in zip(group, group[1:]):
      assert b.started_s >= a.finished_s - 1e-9
  for k in ("gate_up", "down"):
    assert rows[k].shape == (4,) + store.get(1, 0)[k].shape
    for j, e in enumerate([5, 2, 7]):
      np.testing.assert_array_equal(np.asarray(rows[k][j]), store.get(1, e)[k])
    np.testing.assert_array_equal(np.asarray(rows[k][3]), 0.0)     # padding row
  for t, e in zip(group, [5, 2, 7]):                           # per-expert view as well
    np.testing.assert_array_equal(np.asarray(t.wait(0.0)["down"]), store.get(1, e)["down"])


def test_request_many_deduplicates_and_wait_stacked_gathers_across_groups():
  store = make_store()
  with Prefetcher(store, NATIVE) as pf:
    a = pf.request_many(2, [1, 3], "background", pad_to=2)
    b = pf.request_many(2, [3, 6], "sync", pad_to=2)
    assert b[0] is a[1] and b[0].priority == "sync"   # upgraded, not copied twice
    rows = wait_stacked(b, 3)
    a[0].wait(T)
  assert rows["down"].shape[0] == 3
  for j, e in enumerate([3, 6]):
    np.testing.assert_array_equal(np.asarray(rows["down"][j]), store.get(2, e)["down"])


def test_stacked_device_put_owns_its_memory():
  store = make_store()
  src = [store.get(1, 0), store.get(1, 1)]
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  out = stacked_device_put(src, sharding, pad_to=3)
  before = np.asarray(out["gate_up"]).copy()
  src[0]["gate_up"][...] = 7.0                    # writes through to the store's buffer
  np.testing.assert_array_equal(np.asarray(out["gate_up"]), before)
  assert out["gate_up"].shape[0] == 3


# ------------------------------------------------------------ fetch (caller's thread)
def test_fetch_copies_on_the_calling_thread_and_keeps_the_link_time():
  store = make_store()
  link = parse_link("1MB/s,2ms")
  per = link.transfer_time(EXPERT_BYTES)
  gs = GatedStore(store)
  caller = threading.get_ident()
  seen = []
  get = gs.get
  gs.get = lambda l, e: (seen.append(threading.get_ident()), get(l, e))[1]
  with Prefetcher(gs, link) as pf:
    wait_stacked(pf.fetch(2, [0, 1], pad_to=3)[0], 3)     # compiles the stacked copy
    seen.clear()
    t0 = time.perf_counter()
    tickets, rows = pf.fetch(1, [4, 1], pad_to=3)
    copied = time.perf_counter()
    assert seen == [caller, caller]                  # no hand-off to the thread
    assert rows is not None and all(t._arrays is rows for t in tickets)
    assert copied - t0 < 2 * per                      # rows handed out before the link time
    assert not tickets[1].done()
    assert wait_stacked(tickets, 3) is rows           # waits for the link, no device work
    assert time.perf_counter() - t0 >= 2 * per - 1e-9
    assert tickets[1].started_s >= tickets[0].finished_s - 1e-9    # one after another
    assert pf.stats()["transfers"] == 4 and pf.pending() == 0
  for k in ("gate_up", "down"):
    for j, e in enumerate([4, 1]):
      np.testing.assert_array_equal(np.asarray(rows[k][j]), store.get(1, e)[k])
    np.testing.assert_array_equal(np.asarray(rows[k][2]), 0.0)
  before = np.asarray(rows["down"]).copy()
  store.get(1, 4)["down"][...] = 3.0                  # owned: the store's buffer is not aliased
  np.testing.assert_array_equal(np.asarray(rows["down"]), before)


def test_fetch_takes_the_link_after_the_background_piece_and_before_queued_ones():
  link = parse_link("1MB/s,20ms")
  total = link.transfer_time(EXPERT_BYTES)
  with Prefetcher(make_store(), link, background_chunks=4) as pf:
    bg = pf.request(1, 0, "background")
    wait_for(lambda: bg.started_s is not None)
    queued = pf.request(1, 1, "background")
    (s,), _ = pf.fetch(2, [0])
    s.wait(T)
    bg.wait(T)
    queued.wait(T)
  done = s.started_s - bg.started_s
  assert 0 < done < total and abs(done / (total / 4) - round(done / (total / 4))) < 1e-6
  assert s.finished_s - s.started_s >= total - 1e-9
  assert queued.started_s >= s.finished_s - 1e-9 and bg.finished_s >= s.finished_s


def test_fetch_upgrades_a_background_request_for_the_same_expert():
  store = make_store()
  gs = GatedStore(store, block=[(2, 3)])
  with Prefetcher(gs, NATIVE) as pf:
    bg = pf.request(2, 3, "background")
    wait_for(lambda: gs.calls == [(2, 3)])           # the thread is copying it
    tickets, rows = pf.fetch(2, [5, 3], pad_to=2)
    assert tickets[1] is bg and bg.priority == "sync" and rows is None
    gs.gate.set()
    got = wait_stacked(tickets, 2)
  for j, e in enumerate([5, 3]):
    np.testing.assert_array_equal(np.asarray(got["down"][j]), store.get(2, e)["down"])
  assert gs.calls.count((2, 3)) == 1                  # not copied twice


def test_fetch_failure_raises_in_the_caller_and_stops_the_prefetcher():
  gs = GatedStore(make_store(), block=[(2, 1)], fail={(1, 6): OSError("truncated file")})
  with Prefetcher(gs, NATIVE) as pf:
    queued = pf.request(2, 1, "background")
    wait_for(lambda: (2, 1) in gs.calls)             # in flight on the thread
    with pytest.raises(TransferError, match="layer 1 expert.*truncated file") as e:
      pf.fetch(1, [2, 6])
    assert isinstance(e.value.__cause__, OSError)
    gs.gate.set()
    wait_for(lambda: not pf.alive)
    with pytest.raises(TransferError):
      queued.wait(T)                                  # nothing left hanging
    with pytest.raises(TransferError):
      pf.fetch(1, [3])
  assert not pf.alive                                 # close() did not raise again


def test_host_copies_are_private_host_stacks():
  store = make_store()
  with Prefetcher(store, NATIVE, host_copies=True) as pf:
    group = pf.request_many(1, [3, 5], "background", pad_to=3)
    rows = wait_stacked(group, 3)
    tickets, frows = pf.fetch(2, [6])
  assert all(isinstance(v, np.ndarray) and v.shape[0] == 3 for v in rows.values())
  assert all(v.ctypes.data % 64 == 0 for v in list(rows.values()) + list(frows.values()))
  assert isinstance(frows["down"], np.ndarray) and tickets[0]._arrays is frows
  for j, e in enumerate([3, 5]):
    np.testing.assert_array_equal(rows["down"][j], store.get(1, e)["down"])
    assert not np.shares_memory(rows["down"], store.get(1, e)["down"])
  np.testing.assert_array_equal(rows["down"][2], 0.0)
  np.testing.assert_array_equal(frows["gate_up"][0], store.get(2, 6)["gate_up"])


def test_syncs_in_a_row_split_the_background_transfer_once_and_push_queued_ones_back():
  link = parse_link("1MB/s,20ms")
  total = link.transfer_time(EXPERT_BYTES)
  piece = total / 4
  with Prefetcher(make_store(), link, background_chunks=4) as pf:
    wait_stacked(pf.request_many(2, [5, 6], "sync"))   # compiles the stacked copy
    pf.fetch(2, [7])[0][0].wait(T)
    b1, b2 = pf.request_many(1, [0, 1], "background")
    wait_for(lambda: b2.started_s is not None)      # both copied and on the link model
    assert abs(b2.started_s - b1.finished_s) < 1e-9   # queued behind b1
    time.sleep(piece * 1.5)                          # b1 is in its second piece
    t_req = time.perf_counter()                      # (a loaded machine may sleep longer)
    (s1,), _ = pf.fetch(2, [0])
    t_ret = time.perf_counter()
    (s2,), _ = pf.fetch(2, [1])
    for t in (s1, s2, b1, b2):
      t.wait(T)
  done = s1.started_s - b1.started_s
  k = round(done / piece)
  assert abs(done - k * piece) < 1e-6                 # at the end of one of b1's pieces:
  assert t_req - b1.started_s <= k * piece < t_ret - b1.started_s + piece   # the next one
  assert 2 <= k < 4, "the sync fetch did not land inside b1 (the machine stalled)"
  assert abs(s2.started_s - s1.finished_s) < 1e-9     # the second sync right after the first
  assert abs(b1.finished_s - (s2.finished_s + total - done)) < 1e-6   # b1's rest after both
  assert abs(b2.started_s - b1.finished_s) < 1e-6     # b2 had not begun: it moved back whole
  assert b2.finished_s - b2.started_s >= total - 1e-9


# ------------------------------------------------------------ interrupts, memory
def test_an_interrupt_during_a_fetch_propagates_and_leaves_the_prefetcher_working():
  class InterruptedOnce:
    def __init__(self, store):
      self.store, self.fired = store, False

    def get(self, layer, expert):
      if not self.fired:
        self.fired = True
        raise KeyboardInterrupt
      return self.store.get(layer, expert)

  with Prefetcher(InterruptedOnce(make_store()), NATIVE) as pf:
    with pytest.raises(KeyboardInterrupt):
      pf.fetch(1, [3])
    assert pf.alive and pf.pending() == 0
    tickets, _ = pf.fetch(1, [3])                     # not a TransferError: still usable
    np.testing.assert_array_equal(np.asarray(wait_stacked(tickets, timeout=T)["down"][0]),
                                  make_store().get(1, 3)["down"])


def test_collected_background_transfers_are_released_without_a_sync_fetch():
  link = parse_link("1GB/s")
  with Prefetcher(make_store(), link, host_copies=True) as pf:
    for round_ in range(30):                          # background only, never a sync fetch
      tickets = pf.request_many(1, [round_ % E, (round_ + 1) % E], "background", pad_to=2)
      wait_stacked(tickets, timeout=T)
      del tickets
      assert pf.held_bytes() == 0                      # nothing kept once collected
    assert pf.stats()["transfers"] == 60
