"""Time model: the simulator's per-(token, layer) decisions -> time per token.

Per token: `head_s` (embedding, LM head), then per MoE layer, in order:

  1. attention + router: `layer_s`;
  2. if this layer's background admissions of the previous token have not all
     arrived, wait for them (the engine inserts them before the layer); each
     admitted insert costs `admission_overhead_s` on the host;
  3. sync fetches (n > 0): wait for the background piece on the link to end
     (background transfers take the link in `pieces` pieces; a demand fetch
     waits at most for one), then latency + n x expert transfer time, with
     the background paused; plus `fetch_overhead_s` of host work per such layer;
  4. host experts: n x `host_expert_s` (memory-bound on the host CPU);
  5. device experts: n x `expert_s`;
  6. the layer's new admissions join the background queue (FIFO), which drains
     whenever the link is not carrying a sync fetch, overlapping compute.

Expert-parallel (`devices` = N > 1, each device with its own link): a layer's fetches
and its device experts spread evenly over the devices (ceil(n / N) each, as the
engine's interleaved slots make likely), background transfers drain N links at
once, and each MoE layer adds one all-reduce (`collective_s`).

Batched decode (the simulator's `batch` = B): the same model per step of B tokens (a
"token" above is a step): the head and each layer's attention stay one `head_s` and
`layer_s` per step (memory-bound decode reads their weights once per step; the KV reads
that grow with B are not modelled), device experts are the distinct experts the batch
executes (each expert's weights read once), fetches the distinct experts fetched, host
experts per call; time per token = time per step / B.

Link state is kept relative to the current time (backlog seconds, and per layer
how much of the backlog must drain before its admissions have arrived), so the
model is one `lax.scan` over (token, layer) steps, vmapped over policies and
profiles, in float32 without drift.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.offload import hardware
from moejax.research.simulator import STEP_FIELDS

FIELDS = ("head_s", "layer_s", "expert_s", "host_expert_s", "transfer_s", "latency_s",
          "fetch_overhead_s", "admission_overhead_s")


@dataclasses.dataclass(frozen=True)
class TimeParams:
  """Seconds.  transfer_s: one expert over the link, without latency."""
  name: str
  head_s: float
  layer_s: float
  expert_s: float
  host_expert_s: float
  transfer_s: float
  latency_s: float
  fetch_overhead_s: float = 0.0
  admission_overhead_s: float = 0.0
  pieces: int = 4
  source: str = ""
  low_ratio: float = 0.5     # a low-precision copy's bytes / the expert's (int8 ~0.5)
  devices: int = 1           # expert-parallel devices, each with its own link
  collective_s: float = 0.0  # per MoE layer, with devices > 1

  def vector(self) -> np.ndarray:
    return np.asarray([getattr(self, f) for f in FIELDS] + [
        self.pieces, self.low_ratio, self.devices, self.collective_s], np.float32)


def roofline(hw: hardware.HardwareProfile, shape: hardware.ModelShape,
             layer_overhead_s: float = 0.0) -> TimeParams:
  """Memory-bound decode times of `shape` on `hw` (see moejax.offload.hardware)."""
  return TimeParams(
      name=hw.name, head_s=shape.head_bytes / hw.gpu_memory_Bps,
      layer_s=shape.layer_bytes / hw.gpu_memory_Bps + layer_overhead_s,
      expert_s=shape.expert_bytes / hw.gpu_memory_Bps,
      host_expert_s=shape.expert_bytes / hw.host_memory_Bps,
      transfer_s=shape.expert_bytes / hw.link_Bps, latency_s=hw.link_latency_s,
      devices=hw.devices, collective_s=hw.collective_s,
      source=f"roofline: {shape.name} on {hw.gpu} over {hw.link}")


def through_staging(tp: TimeParams, disk: hardware.HardwareProfile, expert_bytes: int,
                    staging_hit_rate: float) -> TimeParams:
  """`tp` with its experts behind a host staging tier (`io.staging`, --host_cache_gb): a
  fetch served from the tier crosses the host link only (tp's transfer_s); one that is not
  is first read from `disk` (its profile's link: bandwidth and a latency per expert read,
  e.g. `ddr5_nvme`, `vm_disk`), so each fetch costs, in expectation, (1 - hit rate) x that
  read more.  The same for background admissions; low-precision copies are held in RAM
  and keep their host-link price.  The hit rate is measured (`StagingCache.counts`)."""
  if not 0.0 <= staging_hit_rate <= 1.0:
    raise ValueError(f"staging_hit_rate={staging_hit_rate}: in [0, 1]")
  t = tp.transfer_s + (1.0 - staging_hit_rate) * (expert_bytes / disk.link_Bps
                                                   + disk.link_latency_s)
  return dataclasses.replace(tp, transfer_s=t,
                             low_ratio=tp.low_ratio * tp.transfer_s / t if t else tp.low_ratio,
                             source=f"{tp.source}; staged at {staging_hit_rate:.0%}, else "
                                    f"{disk.link}")


def _advance(state, dt):
  """dt seconds pass with the link serving the background queue."""
  bg, pos = state
  done = jnp.minimum(dt, bg)
  return bg - done, jnp.maximum(pos - done, 0.0)


def _step(p, carry, x):
  """One (token, layer) step; p = TimeParams.vector(); x = (layer, counts[5])."""
  bg, pos, adm_n, tok = carry
  layer, c = x
  head, layer_s, exp_s, host_s, xfer, lat, f_over, a_over, pieces = (p[i] for i in range(9))
  fetch, host, adm, dev, low = (c[i].astype(jnp.float32) for i in range(5))
  n_dev, coll = p[10], p[11]              # expert-parallel: per device, in parallel
  fetch = jnp.ceil(fetch / n_dev) + jnp.ceil(low / n_dev) * p[9]   # low: low_ratio of bytes
  dev = jnp.ceil(dev / n_dev)
  dt = jnp.where(layer == 0, head, 0.0) + layer_s
  bg, pos = _advance((bg, pos), dt)
  wait = pos[layer]                                # this layer's admissions still on the link
  bg, pos = _advance((bg, pos), wait)
  over = adm_n[layer] * a_over
  bg, pos = _advance((bg, pos), over)
  dt = dt + wait + over
  piece = (xfer + lat) / pieces
  piece_wait = jnp.where((fetch > 0) & (bg > 0), jnp.mod(bg, piece), 0.0)
  bg, pos = _advance((bg, pos), piece_wait)
  sync = jnp.where(fetch > 0, lat + fetch * xfer, 0.0)      # background paused
  rest = (jnp.where(fetch > 0, f_over, 0.0) + host * host_s + dev * exp_s
          + jnp.where(n_dev > 1, coll, 0.0))
  bg, pos = _advance((bg, pos), rest)
  dt = dt + piece_wait + sync + rest
  bg = bg + jnp.ceil(adm / n_dev) * (xfer + lat)
  pos = pos.at[layer].set(jnp.where(adm > 0, bg, 0.0))
  adm_n = adm_n.at[layer].set(adm)
  tok = tok + dt
  return (bg, pos, adm_n, tok), tok


@functools.partial(jax.jit, static_argnames=("num_layers",))
def _token_times(params_9, counts_NxC, layer_N, num_layers: int):
  carry = (jnp.float32(0), jnp.zeros((num_layers,), jnp.float32),
           jnp.zeros((num_layers,), jnp.float32), jnp.float32(0))

  def body(c, x):
    c = c[:3] + (jnp.where(x[0] == 0, 0.0, c[3]),)          # a new token's clock
    return _step(params_9, c, x)

  _, cum = jax.lax.scan(body, carry, (layer_N, counts_NxC))
  return cum


def time_per_token(steps_TxLxC: np.ndarray, tp: TimeParams) -> np.ndarray:
  """Seconds per token [T] for one policy's per-step counts (simulator.STEP_FIELDS)."""
  t, nl, c = steps_TxLxC.shape
  assert c == len(STEP_FIELDS)
  layer = np.tile(np.arange(nl, dtype=np.int32), t)
  cum = _token_times(jnp.asarray(tp.vector()), jnp.asarray(steps_TxLxC.reshape(t * nl, c)),
                     jnp.asarray(layer), nl)
  return np.asarray(cum).reshape(t, nl)[:, -1].astype(np.float64)


def breakdown(steps_TxLxC: np.ndarray, tp: TimeParams, batch: int = 1) -> dict:
  """Mean ms per token of the model's terms, without queueing (for tables); steps of
  `batch` tokens each (the simulator's --batch): a step's time over its tokens."""
  s = steps_TxLxC.astype(np.float64)
  f = {k: s[..., i] for i, k in enumerate(STEP_FIELDS)}
  per = lambda a: np.ceil(a / tp.devices)      # expert-parallel: each device's share
  f["fetches"] = per(f["fetches"]) + tp.low_ratio * per(f["fetches_low"])
  nl = s.shape[1]
  ms = lambda a: 1e3 * float(np.mean(np.sum(a, axis=1))) / batch
  coll = nl * tp.collective_s if tp.devices > 1 else 0.0
  return {"compute_ms": (1e3 * (tp.head_s + nl * tp.layer_s + coll) / batch
                         + ms(per(f["device_calls"]) * tp.expert_s)),
          "sync_transfer_ms": ms((f["fetches"] > 0) * tp.latency_s + f["fetches"] * tp.transfer_s),
          "fetch_overhead_ms": ms((f["fetches"] > 0) * tp.fetch_overhead_s),
          "host_ms": ms(f["host_calls"] * tp.host_expert_s),
          "background_transfer_ms": ms(per(f["admissions"]) * (tp.transfer_s + tp.latency_s))}


# ------------------------------------------------------------------ calibration
def run_engine(cfg, params, store, policy, tokens, prompt: int, link, *, fraction=0.25,
               skip: int = 8, dtype=jnp.float32, repeats: int = 1) -> dict:
  """The engine's statistics on teacher-forced `tokens` (public API only): of the
  fastest of `repeats` runs (a shared machine only slows a run down; decisions are
  the same in every run)."""
  from moejax.kernels import cpu_kernel
  from moejax.offload.engine import EngineConfig, OffloadEngine    # the engine only when timing it
  best = None
  for _ in range(max(1, repeats)):
    with OffloadEngine(cfg, params, store, EngineConfig.make(policy, cache_fraction=fraction,
                                                             link=link, max_len=len(tokens) + 8,
                                                             dtype=dtype)) as eng:
      eng.warmup()
      eng.prefill(tokens[:prompt])
      with cpu_kernel.decoding():
        for t in tokens[prompt:]:
          eng.decode_step(t)
      s = eng.stats(skip=skip)
    if best is None or s["tpot_ms"] < best["tpot_ms"]:
      best = s
  return best


def mean_ms(steps_TxLxC, tp: TimeParams, skip: int) -> float:
  return 1e3 * float(np.mean(time_per_token(steps_TxLxC, tp)[skip:]))


def calibrate_engine(cfg, params, store, tokens, prompt: int, link, steps: dict, *,
                     skip: int = 8, time_host: bool = False, dtype=jnp.float32,
                     repeats: int = 1) -> TimeParams:
  """This machine's TimeParams, from timing the engine here on `tokens` with `link`.

  `steps`: the simulator's per-step counts of "baseline" and "quality" on the same
  tokens (prefill = `prompt`).  Three runs, each fixing one parameter so that the
  time model reproduces that run:
    all experts resident -> layer_s = time per token / MoE layers (head folded in)
    baseline             -> fetch_overhead_s: host time per layer with sync fetches
                            beyond the link time (copy, insert, slower device calls)
    quality              -> admission_overhead_s: host time per background admission
  plus one `host` run for host_expert_s when time_host: its time beyond what the model
  gives it without host experts (its steps, `steps["host"]`, when given; else beyond
  the all-resident run), per host call (the engine computes host experts inside its
  decode program, so no separate host time is measured).  Each run the fastest of
  `repeats`.  Calibrate on other tokens than those a comparison uses.
  """
  t0 = time.time()
  nl = len(cfg.moe_layers)
  run = lambda pol, frac=0.25: run_engine(cfg, params, store, pol, tokens, prompt, link,
                                          fraction=frac, skip=skip, dtype=dtype,
                                          repeats=repeats)
  ebytes = store.expert_nbytes()
  res = run("baseline", 1.0)
  tp = TimeParams(hardware.CALIBRATED, head_s=0.0, layer_s=res["tpot_ms"] * 1e-3 / nl,
                  expert_s=0.0, host_expert_s=0.0,
                  transfer_s=link.transfer_time(ebytes) - link.latency_s,
                  latency_s=link.latency_s)
  base = run("baseline")
  fl = float(np.mean(np.sum(steps["baseline"][skip:, :, 0] > 0, axis=1)))
  over = (base["tpot_ms"] - mean_ms(steps["baseline"], tp, skip)) * 1e-3 / max(fl, 1e-9)
  tp = dataclasses.replace(tp, fetch_overhead_s=max(0.0, over))
  qual = run("quality")
  adm = float(np.mean(np.sum(steps["quality"][skip:, :, 2], axis=1)))
  a_over = (qual["tpot_ms"] - mean_ms(steps["quality"], tp, skip)) * 1e-3 / max(adm, 1e-9)
  tp = dataclasses.replace(tp, admission_overhead_s=max(0.0, a_over))
  host_txt = "host not timed"
  if time_host:
    host = run("host")
    rest = (mean_ms(steps["host"], tp, skip) if "host" in steps else res["tpot_ms"])
    tp = dataclasses.replace(tp, host_expert_s=max(0.0, host["tpot_ms"] - rest) * 1e-3
                             / max(host["host_calls_per_token"], 1e-9))
    host_txt = f"host {host['tpot_ms']:.2f} ms/token"
  return dataclasses.replace(tp, source=(
      f"engine timed here ({link.describe()}), {len(tokens) - prompt - skip} tokens each: "
      f"resident {res['tpot_ms']:.2f}, baseline {base['tpot_ms']:.2f}, quality "
      f"{qual['tpot_ms']:.2f} ms/token, {host_txt}; {time.time() - t0:.0f} s"))
