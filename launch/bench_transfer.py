"""Micro-benchmark of the transfer layer: prefetch-thread overhead and link accuracy.

  python -m launch.bench_transfer --out=bench_transfer.json

For each ExpertStore back-end (numpy, mmap, pinned_host) and each link (native,
and the emulated --link), it times `--n` synchronous fetches one after the
other (request + wait, the stall a decode step sees for one miss) and `--n`
fetches queued at once (the link serialises them).  With an emulated link it
reports how far the measured stall exceeds the link model
(bytes / bandwidth + latency): the machinery's own overhead.  With the native
link it reports the real device_put bandwidth (on a CPU-only machine: a memcpy).

Expert shape: the demo model's (hidden 128, expert 32, f32: 49,152 B) by default,
or Qwen3-30B-A3B's (hidden 2048, expert 768, bf16: 9,437,184 B) with --qwen3.
"""

from __future__ import annotations

import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.offload.host_store import BACKENDS, StoreBackendError, make_store, memory_kinds
from moejax.offload.link import NATIVE, LinkSpecError, parse_link
from moejax.offload.transfer import Prefetcher
from moejax.store import ExpertStore

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_transfer.json", "JSON results file.")
flags.DEFINE_string("link", "100MB/s,100us", "Emulated link timed besides the native one.")
flags.DEFINE_integer("n", 64, "Fetches per measurement.")
flags.DEFINE_bool("qwen3", False, "Use Qwen3-30B-A3B's expert shape (bf16) instead of the demo's.")
flags.DEFINE_list("backends", list(BACKENDS), "Store back-ends to time.")


def expert_store(n_experts: int) -> ExpertStore:
  d, i, dt = (2048, 768, jnp.bfloat16) if FLAGS.qwen3 else (128, 32, np.float32)
  rng = np.random.default_rng(0)
  layer = {"gate_up": rng.standard_normal((n_experts, 2 * i, d), np.float32).astype(dt),
           "down": rng.standard_normal((n_experts, d, i), np.float32).astype(dt)}
  return ExpertStore.from_stacked([layer])


def time_link(store: ExpertStore, link, n: int) -> dict:
  nbytes = store.expert_nbytes()
  model_s = link.transfer_time(nbytes)
  e_count = store.layers[0].num_experts
  with Prefetcher(store, link) as pf:
    pf.request(0, 0).wait(60)  # warm-up
    stalls = []
    for j in range(n):
      t0 = time.perf_counter()
      pf.request(0, (j + 1) % e_count).wait(60)
      stalls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    tickets = [pf.request(0, j % e_count) for j in range(min(n, e_count))]
    for t in tickets:
      t.wait(60)
    queued_s = time.perf_counter() - t0
  stalls = np.array(stalls)
  out = {"link": link.describe(), "link_spec": link.as_dict(), "expert_bytes": nbytes, "model_ms": model_s * 1e3,
         "stall_ms_median": float(np.median(stalls)) * 1e3,
         "stall_ms_p90": float(np.percentile(stalls, 90)) * 1e3,
         "queued_total_ms": queued_s * 1e3, "queued_count": len(tickets),
         "queued_model_ms": len(tickets) * model_s * 1e3,
         "effective_GBps": nbytes * len(tickets) / queued_s / 1e9}
  if link.emulated:
    out["overhead_ms_median"] = out["stall_ms_median"] - out["model_ms"]
  return out


def main(_):
  dev = jax.devices()[0]
  n_experts = 8 if FLAGS.qwen3 else 64
  base = expert_store(n_experts)
  try:
    links = [NATIVE, parse_link(FLAGS.link)]
  except LinkSpecError as e:
    raise app.UsageError(str(e)) from None
  res = {"device": str(dev), "platform": dev.platform, "memory_kinds": memory_kinds(dev),
         "qwen3_shape": FLAGS.qwen3, "results": {}}
  print(f"device {dev} ({dev.platform}); expert {base.expert_nbytes():,} B; n={FLAGS.n}")
  print(f"{'backend':12s} {'link':38s} {'model':>9s} {'stall p50':>10s} {'p90':>8s} "
        f"{'queued':>9s} {'GB/s':>7s}")
  for b in FLAGS.backends:
    try:
      store = make_store(base, b, flag="--backends")
    except StoreBackendError as e:
      raise app.UsageError(str(e)) from None
    for link in links:
      r = time_link(store, link, FLAGS.n)
      res["results"][f"{b} | {link.name}"] = r
      print(f"{b:12s} {link.describe()[:38]:38s} {r['model_ms']:8.3f}m {r['stall_ms_median']:9.3f}m "
            f"{r['stall_ms_p90']:7.3f}m {r['queued_total_ms']:8.2f}m {r['effective_GBps']:7.2f}")
  print("times in ms; 'model' = bytes/bandwidth + latency of the link named on each row")
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=2)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
