"""The demo's side-by-side columns and its busy-machine warning.

The bugs: lines longer than a column wrapped at 46 characters with no mark (a wrapped
line read as two), and a run on a machine with a load of 8 on 2 cores printed its
speed-ups (1.01x) without a word of warning."""

import os

from moejax.cli import demo


def test_a_wrapped_line_ends_in_the_mark():
  long = "def read_config(path):  return open(path).read().split('\\n') + [x for x in y]"
  out = demo.side_by_side(long + "\nshort", "exact", ("quality", "exact"), width=30)
  rows = out.split("\n")[2:]
  left = [r.split(" | ")[0] for r in rows]
  assert all(len(r) == 30 for r in left)
  marked = [r.rstrip().endswith(demo.WRAP_MARK) for r in left]
  k = marked.index(False)                  # the long line's last row, then "short"
  assert k >= 2 and not any(marked[k:]) and left[k + 1].rstrip() == "short"
  joined = "".join(r.rstrip(" ").removesuffix(demo.WRAP_MARK) for r in left[:k])
  joined += left[k].rstrip(" ")
  assert joined == long.rstrip()                          # nothing lost to the wrap
  assert demo.WRAP_MARK not in demo.side_by_side("x" * 30, "y", ("a", "b"), width=30)


def test_busy_machine_warns(monkeypatch):
  monkeypatch.setattr(demo, "cores", lambda: 2)
  monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 6.0, 4.0))
  msg = demo.busy_warning()
  assert msg and "8.0" in msg and "2 cores" in msg and "unreliable" in msg
  monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
  assert demo.busy_warning() is None


def test_cores_is_the_affinity_mask():
  if hasattr(os, "sched_getaffinity"):
    assert demo.cores() == len(os.sched_getaffinity(0))
  assert 1 <= demo.cores() <= (os.cpu_count() or 1)


def test_the_speedup_column_says_higher_is_faster():
  row = lambda ms: dict(tpot_ms=ms, speedup_vs_baseline=4.0 / ms, hit_rate=0.5,
                        substituted_call_pct=0.0, substituted_mass_per_token_layer=0.0,
                        fetches_per_token=1.0, ppl_increase_pct=None)
  out = demo.table({"baseline": row(4.0), "speed": row(2.0)}, "n/a")
  head, _, base, speed = out.split("\n")[:4]
  assert "speedup" in head and "x baseline" not in head
  assert base.split()[2] == "1.00x" and speed.split()[2] == "2.00x"   # half the time: 2x
  assert "higher is faster" in out.split("\n")[-1]
