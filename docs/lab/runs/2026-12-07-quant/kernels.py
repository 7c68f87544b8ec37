"""The quantized CPU kernels (cpu_quant) against the bf16 kernel, 2 threads (XLA's pool and
the decode helpers), bf16 activations, at Qwen3-30B-A3B's shapes: linears 2048 x 768 and
768 x 2048 (an expert's gate/up and down rows) and 4096 x 2048 (q_proj), decode (1 row)
and prompt (128 rows), and one decoded token's routed experts (128 x 768, top-8).

Each linear runs as a lax.scan over L stacked copies of its weight (read in place, one
kernel call a copy), so a decode call streams weights the caches do not hold: "dram" uses
copies of >= 1 GB in all; "warm" one copy over and over (L2/L3-resident). GB/s is weight
bytes read / time; best of 5. Prompt rows: the time a call and the weight bytes /
time.
  PYTHONPATH=. python docs/lab/runs/2026-12-07-quant/kernels.py [--json=out.json]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel, cpu_quant, layer_view

assert cpu_kernel.available()
rng = np.random.default_rng(0)
BYTES = {"bf16": lambda o, c: o * c * 2, "q8_0": lambda o, c: o * c // 32 * 34,
         "q4_0": lambda o, c: o * c // 32 * 18}


def weight(kind, o, c, copies):
  """`copies` stacked copies of one random [o, c] weight: bf16, or random GGUF blocks."""
  if kind == "bf16":
    one = rng.standard_normal((o, c)).astype(np.float32) * 0.02
    return jnp.asarray(np.broadcast_to(one, (copies, o, c)), jnp.bfloat16)
  size = 34 if kind == "q8_0" else 18
  one = rng.integers(0, 256, (o, c // 32, size), dtype=np.uint8)
  one[..., :2] = np.float16(0.01).reshape(1).view(np.uint8)
  return jnp.asarray(np.broadcast_to(one.reshape(o, -1), (copies, o, c // 32 * size)))


def scan_fn(kind):
  """sum over the L copies of x @ w_l.T, one kernel call a copy (read in place)."""
  def body(acc, i, x, w):
    with layer_view.tracing():
      wl = layer_view.at(w, i)
      y = cpu_kernel.linear(x, wl) if kind == "bf16" else cpu_quant.linear_q(x, wl, kind)
    return acc + y.astype(jnp.float32), None

  def run(x, w):
    acc0 = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
    return jax.lax.scan(lambda a, i: body(a, i, x, w), acc0,
                        jnp.arange(w.shape[0], dtype=jnp.int32))[0]
  return jax.jit(run)


def best(f, *args, n=5):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return min(ts)


def linears(out):
  for o, c in ((2048, 768), (768, 2048), (4096, 2048)):
    for kind in ("bf16", "q8_0", "q4_0"):
      nbytes = BYTES[kind](o, c)
      f = scan_fn(kind)
      for rows, mode in ((1, "warm"), (1, "dram"), (128, "warm")):
        copies = max(8, -(-(1 << 30) // nbytes)) if mode == "dram" else 8
        w = weight(kind, o, c, copies)
        x = jnp.asarray(rng.standard_normal((rows, c)), jnp.bfloat16)
        with cpu_kernel.decoding():
          dt = best(f, x, w) / copies
        key = f"{o}x{c} {kind} rows={rows} {mode}"
        out[key] = {"us": dt * 1e6, "gbps": nbytes / dt / 1e9}
        print(f"{key:34s} {dt * 1e6:9.1f} us  {nbytes / dt / 1e9:6.1f} GB/s", flush=True)
        del w


def experts(out):
  """One decoded token's routed experts (top-8 of 128, D 2048, I 768), random ids per
  call: bf16 against q4_0 / q8_0 blocks."""
  e, inter, d, k = 128, 768, 2048, 8
  x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
  g = jnp.full((1, k), 1.0 / k, jnp.float32)
  idss = [jnp.asarray(rng.choice(e, k, replace=False)[None], jnp.int32) for _ in range(64)]
  for kind in ("bf16", "q8_0", "q4_0"):
    gu, dn = weight(kind, 2 * inter, d, e), weight(kind, d, inter, e)
    if kind == "bf16":
      f = jax.jit(lambda x, ids, g: cpu_kernel._expert_call(x, ids, g, gu, dn))
    else:
      w = {"gate_up": gu, "down": dn}
      f = jax.jit(lambda x, ids, g, w=w, q=kind: cpu_quant.expert_ffn_q(
          x, ids, g, w, {"gate_up": q, "down": q}))
    nbytes = k * (BYTES[kind](2 * inter, d) + BYTES[kind](d, inter))
    with cpu_kernel.decoding():
      ts = []
      for _ in range(3):
        jax.block_until_ready(f(x, idss[0], g))
        t = time.perf_counter()
        for ids in idss:
          y = f(x, ids, g)
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t) / len(idss))
    dt = min(ts)
    key = f"experts decode {kind}"
    out[key] = {"us": dt * 1e6, "gbps": nbytes / dt / 1e9}
    print(f"{key:34s} {dt * 1e6:9.1f} us  {nbytes / dt / 1e9:6.1f} GB/s", flush=True)


if __name__ == "__main__":
  print("devices", jax.devices(), "dots:", cpu_kernel.describe(),
        cpu_quant.isa())
  res = {}
  linears(res)
  experts(res)
  for a in sys.argv[1:]:
    if a.startswith("--json="):
      with open(a.split("=", 1)[1], "w") as f:
        json.dump(res, f, indent=1)
