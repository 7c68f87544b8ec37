"""`moejax-serve` with its batch loop timed: Offloaded.step/prompt/take_records, Row.pick/emit and
_finish wrapped with counters; SIGUSR1 prints the totals to stderr (serve_timed.sh sends it)."""
import atexit, collections, time, signal, sys
from moejax.serve import batching
from moejax.offload import batch as obatch
T = collections.Counter(); N = collections.Counter()
def wrap(cls, name, key=None):
  f = getattr(cls, name)
  def g(*a, **k):
    t = time.perf_counter()
    try: return f(*a, **k)
    finally: T[key or name] += time.perf_counter() - t; N[key or name] += 1
  setattr(cls, name, g)
wrap(batching.Offloaded, "step"); wrap(batching.Offloaded, "prompt"); wrap(batching.Offloaded, "take_records")
wrap(batching.Row, "pick"); wrap(batching.Row, "emit"); wrap(batching, "_finish")
orig_serve = batching.serve
def serve(*a, **k):
  t = time.perf_counter()
  try: return orig_serve(*a, **k)
  finally: T["serve_total"] += time.perf_counter() - t
batching.serve = serve
from moejax.serve import worker
if hasattr(worker, "batching"): worker.batching.serve = serve
def report(*_):
  steps = N["step"] or 1
  print("steps", steps, file=sys.stderr)
  for k, v in T.most_common(): print("%-14s %8.1f ms total  %6.3f ms/step  n=%d" % (k, 1e3*v, 1e3*v/steps, N[k]), file=sys.stderr)
  sys.stderr.flush()
signal.signal(signal.SIGUSR1, report)
from moejax.serve import main
main.entry()
