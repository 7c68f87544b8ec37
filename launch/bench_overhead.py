"""Where an offload preset's time per token goes, next to the all-resident engine.

  python -m launch.bench_overhead --out=bench_overhead.json

Same model, streams, budget and flags as `launch.bench_offload` (its flags apply,
but only the first --links entry is used, and a scaled link is always sized
against the jitted model's layer time).  Two measurements, side by side in one run:

1. A timeline per decoded token (`OffloadEngine.trace`), cut into segments
   (`moejax.offload.timeline`: attend call, host work before the fetch or the moe
   call, fetch window = link time + queueing and overrun, moe call, ...) and
   averaged over the timed tokens, in ms per token, for the all-resident engine and
   each preset; MoE layers with a synchronous fetch ("F") apart from those without
   ("N").  The segments add up to `total`, the measured time per token.
2. One layer's moe call timed right after its attend call with something in
   between (nothing; 0.5 ms of Python; the engine's 0.5 ms yielding link wait; a
   resident insert; a helper thread woken to run ~50 us of Python, as the prefetch
   thread does): on a CPU backend the "device" is the host CPU, so host work
   between two device calls makes the next one slower.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from launch import bench_offload as bo
from moejax.offload import engine as engine_lib
from moejax.offload.timeline import SEGMENTS, segments

FLAGS = flags.FLAGS
FLAGS.set_default("out", "bench_overhead.json")
flags.DEFINE_integer("context_reps", 200, "Repetitions of each context measurement.")

def context_times(eng, reps: int) -> dict:
  """Median us of one MoE layer's moe call after its attend call, per kind of host work
  in between (see the module docstring)."""
  i = eng.moe_layers[len(eng.moe_layers) // 2]
  st, p = eng._layer_steps[i], eng.params[f"layers_{i}"]  # pylint: disable=protected-access
  x, tp = eng._embed_decode(eng.params, np.asarray([1, eng.end_index], np.int32))  # pylint: disable=protected-access
  zero_x = np.zeros((1, 1, eng.cfg.hidden_size), jnp.dtype(eng.dtype))
  # an insert of nothing (its rows go to the scratch row), packed as the engine packs it
  ins, r = eng._ins([], np.zeros(eng.cfg.num_experts, bool))  # pylint: disable=protected-access
  rows = {k: np.zeros((r,) + np.shape(v), np.asarray(v).dtype)
          for k, v in eng.store.get(i, 0).items()}
  wake, stop = threading.Event(), [False]

  def python_for(s):
    end = time.perf_counter() + s
    while time.perf_counter() < end:
      pass

  def helper():
    while not stop[0]:
      wake.wait()
      wake.clear()
      python_for(5e-5)

  th = threading.Thread(target=helper, daemon=True)
  th.start()

  def insert():
    eng.states[i], _ = eng._insert_rows(eng.states[i], ins, rows)  # pylint: disable=protected-access
    jax.block_until_ready(eng.states[i].step)

  between = {
      "nothing": lambda: None,
      "0.5 ms of Python": lambda: python_for(5e-4),
      "0.5 ms yielding wait": lambda: engine_lib.transfer_lib.sleep_until(
          time.perf_counter() + 5e-4, float("inf")),
      "a resident insert": insert,
      "a helper thread woken": wake.set,
  }
  times = {k: [] for k in between}
  for _ in range(reps):
    for name, fn in between.items():
      h, moe_in, eng.cache[i], dec, packed = st["attend_decide"](p, x, tp, eng.cache[i],
                                                                 eng.states[i])
      np.asarray(packed)
      fn()
      t0 = time.perf_counter()
      y, eng.states[i] = st["moe"](p, h, moe_in, dec, zero_x, eng.states[i])
      jax.block_until_ready(y)
      times[name].append(time.perf_counter() - t0)
      time.sleep(2e-4)               # let a woken helper finish before the next round
  stop[0] = True
  wake.set()
  return {k: 1e6 * float(np.median(v)) for k, v in times.items()}


def main(_):
  dtype = jnp.dtype(FLAGS.dtype)
  if jax.devices()[0].platform == "cpu":
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  cfg, params, store, tok_path, desc = bo.load(dtype)
  n = FLAGS.prompt_len + FLAGS.warmup_tokens + FLAGS.decode_tokens
  prof_stream, stream = bo.token_streams(cfg, tok_path, n)
  counts = engine_lib.profile_counts(cfg, params, store, prof_stream, dtype)
  ebytes = store.expert_nbytes()
  link = engine_lib.resolve_link(FLAGS.links[0], cfg, params, store, dtype)
  mk = lambda pol, f: bo.make_engine(cfg, params, store, pol, link, stream, counts, dtype, f)
  engines = {"all resident": mk("baseline", 1.0)}
  engines.update({preset: mk(preset, FLAGS.cache_fraction) for preset in FLAGS.presets})
  for eng in engines.values():
    eng.trace = True
  print(f"[bench_overhead] {desc}; link {link.describe()}; {FLAGS.decode_tokens} timed tokens",
        file=sys.stderr)
  bo.run_interleaved(list(engines.values()), stream)
  per_fetch = (link.transfer_time(ebytes) if link.emulated
               else bo.native_transfer_seconds(store, cfg.moe_layers[0],
                                               engines["all resident"]._host_rows))  # pylint: disable=protected-access
  seg = {}
  for name, eng in engines.items():
    s = eng.stats(skip=FLAGS.warmup_tokens)
    seg[name] = segments(eng.traces[FLAGS.warmup_tokens:], per_fetch, s["fetches_per_token"])
    seg[name]["tpot_ms"] = s["tpot_ms"]
  context = context_times(engines["all resident"], FLAGS.context_reps)
  for eng in engines.values():
    eng.close()
  result = dict(model=desc, link=link.describe(), expert_transfer_ms=1e3 * per_fetch,
                device=str(jax.devices()[0]), decode_tokens=FLAGS.decode_tokens,
                segments_ms_per_token=seg, moe_call_us_after=context)
  print(table(seg, link.describe()))
  print("\none moe call (us, median) right after its attend call, with in between:")
  for k, v in context.items():
    print(f"  {k:<24}{v:>8.1f}  ({v / context['nothing']:.2f}x)")
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"[bench_overhead] wrote {FLAGS.out}", file=sys.stderr)


def table(seg: dict, link_desc: str) -> str:
  names = list(seg)
  lines = [f"ms per token, link: {link_desc}",
           f"{'segment':<24}" + "".join(f"{n:>16}" for n in names)]
  for k in SEGMENTS + ("F layers per token", "N layers per token"):
    lines.append(f"{k:<24}" + "".join(f"{seg[n].get(k, 0.0):>16.3f}" for n in names))
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
