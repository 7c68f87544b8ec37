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
   ("N").  The segments add up to `total`, the measured time per token.  The
   timeline needs every layer's marks, so the engines make one call per MoE layer
   (--run_layers defaults to false here).
2. One layer's moe call timed right after its attend call with something in
   between (nothing; 0.5 ms of Python; the engine's 0.5 ms yielding link wait; a
   resident insert; a helper thread woken to run ~50 us of Python, as the prefetch
   thread does): on a CPU backend the "device" is the host CPU, so host work
   between two device calls makes the next one slower.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import threading
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from launch import bench_offload as bo
from moejax.model import init_cache
from moejax.offload import calibrate
from moejax.offload import resident
from moejax.offload import steps as steps_lib
from moejax.offload.policy import make_policy
from moejax.offload.timeline import SEGMENTS, segments
from moejax.offload.tickets import sleep_until

FLAGS = flags.FLAGS
FLAGS.set_default("out", "bench_overhead.json")
FLAGS.set_default("run_layers", False)
flags.DEFINE_integer("context_reps", 200, "Repetitions of each context measurement.")

def context_times(cfg, params, store, dtype, reps: int) -> dict:
  """Median us of one MoE layer's moe call after its attend call, per kind of host work
  in between (see the module docstring); the layer's steps as the engine builds them,
  on their own state with every expert of the layer resident."""
  i = cfg.moe_layers[len(cfg.moe_layers) // 2]
  put = functools.partial(jax.device_put, device=jax.devices()[0])
  policy = make_policy("baseline")
  st = steps_lib.layer_steps(cfg, dtype, i, policy.decision, policy.cache, None)
  params = put(params)
  p = params[f"layers_{i}"]
  first = store.get(i, 0)
  spec = {k: (np.shape(v), jnp.dtype(np.asarray(v).dtype)) for k, v in first.items()}
  state = resident.fill(put(resident.init_state(cfg.num_experts, cfg.num_experts, spec)),
                        range(cfg.num_experts), functools.partial(store.get, i), policy.cache,
                        chunk=cfg.top_k)
  kv = put(init_cache(cfg, 1, 8, dtype)[i])
  x, tp = steps_lib.model_steps(cfg, dtype).embed_decode(params, np.asarray([1, 0], np.int32))
  zero_x = np.zeros((1, 1, cfg.hidden_size), jnp.dtype(dtype))
  r = min(2, cfg.top_k)       # an insert of nothing (its rows go to the scratch row)
  ins = steps_lib.pack_insert([], np.zeros(cfg.num_experts, bool), r)
  rows = {k: np.zeros((r,) + np.shape(v), np.asarray(v).dtype) for k, v in first.items()}
  wake, stop = threading.Event(), threading.Event()

  def python_for(s):
    end = time.perf_counter() + s
    while time.perf_counter() < end:
      pass

  def helper():
    while not stop.is_set():
      wake.wait()
      wake.clear()
      python_for(5e-5)

  def insert():
    nonlocal state
    state, _ = st.insert(state, ins, rows)
    jax.block_until_ready(state.step)

  between = {
      "nothing": lambda: None,
      "0.5 ms of Python": lambda: python_for(5e-4),
      "0.5 ms yielding wait": lambda: sleep_until(time.perf_counter() + 5e-4, float("inf")),
      "a resident insert": insert,
      "a helper thread woken": wake.set,
  }
  times = {k: [] for k in between}
  th = threading.Thread(target=helper, daemon=True)
  th.start()
  try:
    for _ in range(reps):
      for name, fn in between.items():
        h, moe_in, kv, dec, packed = st.attend_decide(p, x, tp, kv, state)
        np.asarray(packed)
        fn()
        t0 = time.perf_counter()
        y, state, _ = st.moe(p, h, moe_in, dec, zero_x, state)
        jax.block_until_ready(y)
        times[name].append(time.perf_counter() - t0)
        time.sleep(2e-4)             # let a woken helper finish before the next round
  finally:
    stop.set()
    wake.set()
    th.join()
  return {k: 1e6 * float(np.median(v)) for k, v in times.items()}


def main(_):
  with contextlib.ExitStack() as stack:
    run(stack)


def run(stack: contextlib.ExitStack):
  dtype = jnp.dtype(FLAGS.dtype)
  if jax.devices()[0].platform == "cpu":
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  cfg, params, store, tok_path, desc = bo.load(dtype)
  n = FLAGS.prompt_len + FLAGS.warmup_tokens + FLAGS.decode_tokens
  prof_stream, stream = bo.token_streams(cfg, tok_path, n)
  counts = calibrate.profile_counts(cfg, params, store, prof_stream, dtype)
  ebytes = store.expert_nbytes()
  link = calibrate.calibrated_link(FLAGS.links[0], cfg, params, store, dtype)
  mk = lambda pol, f: bo.make_engine(stack, cfg, params, store, pol, link, stream, counts, dtype, f)
  engines = {"all resident": mk("baseline", 1.0)}
  engines.update({preset: mk(preset, FLAGS.cache_fraction) for preset in FLAGS.presets})
  for eng in engines.values():
    eng.trace = True
  print(f"[bench_overhead] {desc}; link {link.describe()}; {FLAGS.decode_tokens} timed tokens",
        file=sys.stderr)
  bo.run_interleaved(list(engines.values()), stream)
  per_fetch = (link.transfer_time(ebytes) if link.emulated
               else bo.native_transfer_seconds(store, cfg.moe_layers[0],
                                               engines["all resident"].transfer_stats()[
                                                   "host_copies"]))
  seg = {}
  for name, eng in engines.items():
    s = eng.stats(skip=FLAGS.warmup_tokens)
    seg[name] = segments(eng.traces[FLAGS.warmup_tokens:], per_fetch, s["fetches_per_token"])
    seg[name]["tpot_ms"] = s["tpot_ms"]
  context = context_times(cfg, params, store, dtype, FLAGS.context_reps)
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
