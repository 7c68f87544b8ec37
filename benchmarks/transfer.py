"""One expert's copy as the engine makes it: in-program, from the host store to a slot.

  python -m launch.bench_transfer --out=bench_transfer.json

The engine's decode program copies a fetched expert itself (`moejax.offload.sources.
copy_rows`, called here as the engine calls it): the store's stacked `[E, ...]` arrays
(`moejax.io.placement.program_store`; in pinned host memory on an accelerator) read at the
expert and written into a slot buffer, on the CPU by one kernel call a tensor, split over
both threads when large (`kernels/cpu_rows.cc`).
Per `--store` back-end (numpy, mmap, pinned_host) this times

  copy_ms          one jitted call that copies one expert (dispatch included);
  copy_in_loop_ms  per expert, `--n` copies in one jitted call (the copy alone, as in
                   the decode program, where no extra dispatch is paid);
  device_put_ms    an eager `jax.device_put` of the same expert (`store.get`); on the CPU
                   backend it may alias the host buffer (`device_put_aliases`), copying
                   nothing;

each the median of `--reps` runs.  Expert shape: the demo model's (hidden 128, expert
32, f32: 49,152 B), or Qwen3-30B-A3B's (hidden 2048, expert 768, bf16: 9,437,184 B)
with --qwen3.  `expert_copy_seconds` is what launch.bench_offload uses for its bound.
"""

from __future__ import annotations

import functools
import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.io import placement
from moejax.offload import sources
from moejax.io.store import (BACKENDS, StoreBackendError, make_store, shares_buffer,
                                      store_backend)
from moejax.io.store import ExpertStore

FLAGS = flags.FLAGS


def define_flags():
  """This command's flags (defined only when it runs: launch.bench_offload imports
  `expert_copy_seconds` and has flags of the same names)."""
  flags.DEFINE_string("out", "bench_transfer.json", "JSON results file.")
  flags.DEFINE_integer("n", 16, "Copies per call of the loop measurement.")
  flags.DEFINE_integer("reps", 30, "Timed runs per measurement (median).")
  flags.DEFINE_bool("qwen3", False, "Use Qwen3-30B-A3B's expert shape (bf16) instead of the "
                    "demo's.")
  flags.DEFINE_list("store", list(BACKENDS), "Store back-ends to time.")


def _copy(bufs, stack, e, slot, pinned):
  """Expert `e` of `stack` into row `slot` of `bufs` by the engine's in-program copy
  (`sources.copy_rows`). The buffers have the store's dtype (16-bit floats are held as
  their uint16 bits)."""
  return sources.copy_rows(bufs, stack, jnp.reshape(e, (1,)), jnp.reshape(slot, (1,)),
                           pinned)


@functools.partial(jax.jit, static_argnames=("pinned",), donate_argnums=(0,))
def copy_one(bufs, stack, e, slot, *, pinned: bool):
  """Expert `e` of `stack` into row `slot` of `bufs`."""
  return _copy(bufs, stack, e, slot, pinned)


@functools.partial(jax.jit, static_argnames=("n", "pinned"), donate_argnums=(0,))
def copy_loop(bufs, stack, first, *, n: int, pinned: bool):
  """Experts first, first+1, ... (mod E) into rows 0, 1, ... (mod slots): n copies."""
  e_count = next(iter(stack.values())).shape[0]
  rows = next(iter(bufs.values())).shape[0]
  return jax.lax.fori_loop(0, n, lambda j, b: _copy(b, stack, (first + j) % e_count,
                                                    j % rows, pinned), bufs)


def _median_s(fn, reps: int) -> float:
  fn()                                   # compile / warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def expert_copy_seconds(store: ExpertStore, layer: int | None = None, n: int = 16,
                        reps: int = 30) -> dict:
  """{"copy_s", "copy_in_loop_s", "device_put_s", "device_put_aliases"} for one expert of
  `layer` (default: the first MoE layer) of `store` (see the module docstring)."""
  dev = jax.devices()[0]
  layer = store.moe_layers[0] if layer is None else layer
  one = ExpertStore({layer: store.layers[layer]}, store.num_layers,  # this layer only
                    backend=store_backend(store))
  progs, pinned = placement.program_store(one, dev)
  stack = progs[layer]
  e_count = store.layers[layer].num_experts
  slots = min(n, e_count)
  bufs = {k: jnp.zeros((slots,) + v.shape[1:], v.dtype, device=dev) for k, v in stack.items()}
  state = {"bufs": bufs, "i": 0}

  def one():
    state["i"] += 1
    state["bufs"] = copy_one(state["bufs"], stack, np.int32(state["i"] % e_count),
                             np.int32(state["i"] % slots), pinned=pinned)
    jax.block_until_ready(state["bufs"])

  def loop():
    state["i"] += n
    state["bufs"] = copy_loop(state["bufs"], stack, np.int32(state["i"] % e_count), n=n,
                              pinned=pinned)
    jax.block_until_ready(state["bufs"])

  sharding = jax.sharding.SingleDeviceSharding(dev)
  aliases = []

  def put():
    state["i"] += 1
    src = store.get(layer, state["i"] % e_count)
    out = {k: jax.device_put(v, sharding) for k, v in src.items()}
    jax.block_until_ready(out)
    aliases.append(any(shares_buffer(out[k], v) for k, v in src.items()))

  return {"copy_s": _median_s(one, reps), "copy_in_loop_s": _median_s(loop, reps) / n,
          "device_put_s": _median_s(put, reps), "device_put_aliases": any(aliases),
          "pinned": pinned, "expert_bytes": store.expert_nbytes()}


def expert_store(n_experts: int) -> ExpertStore:
  d, i, dt = (2048, 768, jnp.bfloat16) if FLAGS.qwen3 else (128, 32, np.float32)
  rng = np.random.default_rng(0)
  layer = {"gate_up": rng.standard_normal((n_experts, 2 * i, d), np.float32).astype(dt),
           "down": rng.standard_normal((n_experts, d, i), np.float32).astype(dt)}
  return ExpertStore.from_stacked([layer])


def main(_):
  dev = jax.devices()[0]
  base = expert_store(32 if FLAGS.qwen3 else 64)
  res = {"device": str(dev), "platform": dev.platform, "qwen3_shape": FLAGS.qwen3,
         "expert_bytes": base.expert_nbytes(), "n": FLAGS.n, "reps": FLAGS.reps, "results": {}}
  print(f"device {dev}; expert {base.expert_nbytes():,} B; median of {FLAGS.reps}")
  print(f"{'store':12s} {'copy ms':>9s} {'in loop ms':>11s} {'GB/s':>7s} {'device_put ms':>14s}")
  for b in FLAGS.store:
    try:
      store = make_store(base, b)
    except StoreBackendError as e:
      raise app.UsageError(str(e)) from None
    r = expert_copy_seconds(store, n=FLAGS.n, reps=FLAGS.reps)
    row = {"copy_ms": 1e3 * r["copy_s"], "copy_in_loop_ms": 1e3 * r["copy_in_loop_s"],
           "copy_in_loop_GBps": r["expert_bytes"] / max(r["copy_in_loop_s"], 1e-12) / 1e9,
           "device_put_ms": 1e3 * r["device_put_s"],
           "device_put_aliases": r["device_put_aliases"], "pinned": r["pinned"]}
    res["results"][b] = row
    print(f"{b:12s} {row['copy_ms']:9.4f} {row['copy_in_loop_ms']:11.4f} "
          f"{row['copy_in_loop_GBps']:7.2f} {row['device_put_ms']:14.4f}"
          f"{'  (aliased: no copy)' if row['device_put_aliases'] else ''}")
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  print(f"wrote {FLAGS.out}")
