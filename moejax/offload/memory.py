"""How much host RAM and device memory a model needs, computed from its config alone.

`plan_memory` answers before anything is loaded (a 30B-parameter checkpoint takes
minutes to read), from the same shapes the loader and the engine use:

  dense parameters   every parameter that is not a routed expert (embeddings,
                     attention, norms, routers, shared experts, dense MLPs), on the
                     device, in the dtype each leaf has (`model.abstract_params`);
  one expert         the bytes one routed expert occupies, and moves per fetch;
  expert cache       with a policy: `resident.make_budget`'s slots + staging slots +
                     the scratch row, per MoE layer; without one: every expert;
  KV cache           `model.init_cache` for the sequence length (shape only);
  prefill fetches    transient: a long prompt may need every non-resident expert
                     of one layer at once (at most E experts).

Where each byte lives (the tiers, docs/engine.md "Memory tiers"):

  anonymous RAM   what the process owns: the expert store for ``numpy`` and
                  ``pinned_host`` (page-locked), the host staging tier of ``mmap`` with
                  --host_cache_gb (`io.staging`), and on the CPU backend everything the
                  "device" holds too (device memory *is* host RAM there);
  page cache      ``mmap``: the experts stay in the (repacked, `io.repack`) checkpoint
                  file and are read through the OS page cache, which keeps what fits and
                  drops the rest under pressure: file-backed, never counted as owned;
  device memory   dense parameters, the expert cache, the KV cache and, on an
                  accelerator, the prompt pass's transient copy of one layer (on the CPU
                  backend the prompt pass reads the store in place: no copy; without the
                  CPU kernels, one expert at a time).

`MemoryPlan.anon_bytes` is what a run's anonymous RSS should stay within (plus the
runtime's own few hundred MB: jax, XLA's executables, Python).  What a run really holds
is measured here too: /proc's VmHWM mixes anonymous and file pages, so `AnonWatch`
samples RssAnon on a thread and keeps its peak (`status()` reads the figures once,
`read_bytes()` the disk bytes a process read; Linux only, elsewhere None):

  with AnonWatch() as w:
    run()
  w.peak_anon, w.read_bytes
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.config import ModelConfig


def tree_nbytes(tree) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree."""
  return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree_util.tree_leaves(tree)))


def checkpoint_is_mxfp4(model_dir: str) -> bool:
  """Whether a folder's routed experts are stored as MXFP4 blocks (gpt_oss hub files)."""
  from moejax.io.safetensors_io import SafetensorsFile
  index = os.path.join(model_dir, "model.safetensors.index.json")
  single = os.path.join(model_dir, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      names = list(json.load(f).get("weight_map", {}))
  elif os.path.exists(single):
    names = list(SafetensorsFile(single).keys())
  else:
    return False
  return any(n.endswith("_proj_blocks") for n in names)


def expert_nbytes(cfg: ModelConfig, dtype, mxfp4: bool = False) -> int:
  """Bytes of one routed expert as the store holds it: every tensor in `dtype`, except
  gpt_oss MXFP4 blocks and scales, which stay one byte per element (biases in `dtype`)."""
  from moejax.model import families
  item = jnp.dtype(dtype).itemsize
  if mxfp4:
    shapes = families.of(cfg).expert_shapes(cfg, "mxfp4")
    return int(sum(np.prod(s) * (item if k.endswith("bias") else 1) for k, s in shapes.items()))
  return int(sum(np.prod(s) * item for s in families.of(cfg).expert_shapes(cfg).values()))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes a run needs; `lines()` says where each figure comes from."""
  store: str                 # "numpy" | "mmap" | "pinned_host"
  offload: bool              # False: every expert on the device (no --policy)
  dense_bytes: int
  expert_bytes: int          # one routed expert
  num_moe_layers: int
  num_experts: int           # per MoE layer
  cache_slots: int           # physical slots per MoE layer (+ scratch row when offloading)
  kv_len: int
  kv_bytes: int
  prefill_bytes: int         # transient, at most
  platform: str = "cpu"      # the backend: "cpu" (device memory is host RAM) or an accelerator
  stacked_bytes: int = 0     # the scanned engine's [L, ...] copy of the layers' parameters:
                             # both are held while it is made (the programs then free
                             # the loaded ones: generate, serve)
  host_cache_bytes: int = 0  # --host_cache_gb: the host staging tier, whole experts
  store_copied: bool = False # a mapped store copied whole into RAM (a misaligned GGUF)

  @property
  def all_experts_bytes(self) -> int:
    return self.expert_bytes * self.num_experts * self.num_moe_layers

  @property
  def expert_cache_bytes(self) -> int:
    return self.expert_bytes * self.cache_slots * self.num_moe_layers

  @property
  def host_bytes(self) -> int:
    """Host RAM the expert store keeps (the dense parameters only pass through)."""
    if self.store == "mmap" and not self.store_copied:
      return self.host_cache_bytes
    return self.all_experts_bytes

  @property
  def device_bytes(self) -> int:
    return (self.dense_bytes + self.stacked_bytes + self.expert_cache_bytes + self.kv_bytes
            + self.prefill_bytes)

  @property
  def page_cache_bytes(self) -> int:
    """File-backed pages the run reads (at most; the kernel reclaims them)."""
    return self.all_experts_bytes if self.store == "mmap" else 0

  @property
  def anon_bytes(self) -> int:
    """Anonymous RAM the process owns: the host store, plus the device's share on the
    CPU backend.  Without a policy on the CPU the experts are read where the store holds
    them (`ExpertStore.device_experts`), so they count once, as the store."""
    if self.platform != "cpu":
      return self.host_bytes
    if not self.offload:
      return self.host_bytes + self.device_bytes - self.expert_cache_bytes
    return self.host_bytes + self.device_bytes

  def lines(self) -> list[str]:
    if self.host_cache_bytes:
      host = (f"{gb(self.host_cache_bytes)} host staging (--host_cache_gb: "
              f"{self.host_cache_bytes // self.expert_bytes} experts x {mb(self.expert_bytes)}, "
              f"admitted by frequency); the other experts are read from the checkpoint "
              f"({gb(self.all_experts_bytes)}) through the OS page cache")
    elif self.store_copied:
      host = (f"{gb(self.all_experts_bytes)} in RAM for every expert (--store=mmap, but the "
              f"GGUF's data starts off jax's 64-byte boundary, so the mapped experts are "
              f"copied; `moejax-align-gguf` aligns the file once)")
    elif self.store == "mmap":
      host = (f"0 B of experts kept in RAM (--store=mmap: the {gb(self.all_experts_bytes)} of "
              f"experts are read from the checkpoint through the OS page cache)")
    else:
      where = "pinned host memory" if self.store == "pinned_host" else "RAM"
      host = (f"{gb(self.host_bytes)} in {where} for every expert (--store={self.store}: "
              f"{self.num_moe_layers} layers x {self.num_experts} experts x "
              f"{mb(self.expert_bytes)})")
    host += f"; the dense parameters ({gb(self.dense_bytes)}) pass through once while loading"
    if self.offload:
      cache = (f"expert cache {gb(self.expert_cache_bytes)} ({self.cache_slots} slots incl. "
               f"staging + scratch x {self.num_moe_layers} layers x {mb(self.expert_bytes)})")
      extra = f" + prompt prefill fetches up to {gb(self.prefill_bytes)}"
    else:
      cache = f"every expert {gb(self.expert_cache_bytes)} (no --policy: all resident)"
      extra = ""
    if self.platform == "cpu" and not self.offload:
      cache = (f"every expert read where the store holds it ({gb(self.all_experts_bytes)}, "
               f"no --policy)")
    elif self.platform == "cpu" and self.offload and not self.prefill_bytes:
      extra = " (the prompt pass reads the store in place)"
    shared = self.platform == "cpu" and not self.offload     # experts counted as the store
    stacked = (f" + the layers' parameters stacked for the scan {gb(self.stacked_bytes)} "
               "(both held while the engine is built)" if self.stacked_bytes else "")
    device = (f"{gb(self.device_bytes - (self.expert_cache_bytes if shared else 0))}"
              f" = dense parameters {gb(self.dense_bytes)}{stacked} + {cache} + "
              f"KV cache {gb(self.kv_bytes)} ({self.kv_len} positions){extra}")
    out = [f"host RAM       {host}", f"device memory  {device}"]
    if self.platform == "cpu":
      out.append(f"anonymous RAM  {gb(self.anon_bytes)} owned by the process (the CPU backend's "
                 f"device memory is host RAM; plus the runtime's few hundred MB)")
    else:
      out.append(f"anonymous RAM  {gb(self.anon_bytes)} owned by the process on the host")
    if self.page_cache_bytes:
      out.append(f"page cache     up to {gb(self.page_cache_bytes)} of the mapped experts, "
                 f"file-backed: the OS keeps what fits and reads the rest from disk")
    return out

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(host_bytes=self.host_bytes, device_bytes=self.device_bytes,
             expert_cache_bytes=self.expert_cache_bytes, all_experts_bytes=self.all_experts_bytes,
             anon_bytes=self.anon_bytes, page_cache_bytes=self.page_cache_bytes)
    return d


def plan_memory(cfg: ModelConfig, dtype, *, store: str = "numpy", offload: bool = True,
                cache_fraction: float | None = 0.25, cache_bytes: int | None = None,
                kv_len: int = 4096, mxfp4: bool = False,
                platform: str | None = None, host_cache_gb: float | None = None,
                weights: str = "float", nbytes: tuple[int, int] | None = None,
                store_copied: bool = False) -> MemoryPlan:
  """The memory a run of `cfg` needs (see the module docstring); raises BudgetError for
  a budget the engine would refuse, with the same message.  platform: the backend
  (default: jax's first device's).  host_cache_gb: the host staging tier (`io.staging`;
  StagingError for a size below one expert per MoE layer or a store other than mmap);
  its prompt pass holds one expert at a time (the "prefill" bytes, on the CPU backend
  too).  weights: --weights (a block format: the linears' and experts' blocks counted,
  `io.weights.quantized`); nbytes: (dense bytes, one expert's bytes) as a file holds them
  (a GGUF file: `gguf_file.nbytes`), instead of computed from `dtype` and `weights`.
  store_copied: the mapped store is copied whole into RAM (`gguf_align.copied_whole`: a
  GGUF off jax's 64-byte boundary, every expert resident or --policy=host)."""
  from moejax.io import staging
  from moejax.model.model import abstract_params, init_cache
  from moejax.cache import resident
  from moejax.model import families
  from moejax.io.weights import quantized
  quantized.check_weights(weights)
  ebytes = (nbytes[1] if nbytes else quantized.expert_nbytes(cfg, weights)
            if weights != "float" else expert_nbytes(cfg, dtype, mxfp4))
  n_moe = len(cfg.moe_layers)
  if offload:
    budget = resident.make_budget(cfg.num_experts, cfg.top_k, ebytes, n_moe,
                                  fraction=None if cache_bytes else cache_fraction,
                                  nbytes=cache_bytes)
    slots = budget.physical + 1                      # + the scratch row
    platform = platform or jax.devices()[0].platform
    # the CPU backend's prompt pass reads the store in place (`sources.prompt_table`), or
    # without the kernels one expert at a time (`sources.reads_one_at_a_time`)
    plain = set(families.of(cfg).expert_shapes(cfg)) == {"gate_up", "down"} and not mxfp4
    prefill = 0 if platform == "cpu" and plain else cfg.num_experts * ebytes
    if host_cache_gb is not None:
      staged = staging.staging_rows(host_cache_gb, ebytes, n_moe, store) * ebytes
      prefill = ebytes      # the prompt's experts are read and run one at a time
  else:
    slots, prefill = cfg.num_experts, 0
  if host_cache_gb is not None and not offload:
    raise staging.StagingError("--host_cache_gb stages the experts the offload engine "
                               "fetches: it needs --policy")
  kv = jax.eval_shape(lambda: init_cache(cfg, 1, kv_len, dtype))
  params = abstract_params(cfg, dtype)
  # the engine's layer scan (a uniform model) stacks the layers' parameters
  # (`decode.stack_params`): one more copy of them while the engine is built (the peak);
  # moejax-generate and moejax-serve then drop the loaded ones
  from moejax.model import layer_stack
  layers = {k: v for k, v in params.items() if k.startswith("layers_")}
  dense = lambda t: (quantized.dense_nbytes(t, weights, dtype) if weights != "float"
                     else tree_nbytes(t))
  dense_bytes = nbytes[0] if nbytes else dense(params)
  stacked = ((dense(layers) if not nbytes else dense_bytes)
             if offload and layer_stack.uniform(cfg) and host_cache_gb is None else 0)
  return MemoryPlan(store=store, offload=offload, stacked_bytes=stacked,
                    dense_bytes=dense_bytes, expert_bytes=ebytes,
                    num_moe_layers=n_moe, num_experts=cfg.num_experts, cache_slots=int(slots),
                    kv_len=kv_len, kv_bytes=tree_nbytes(kv), prefill_bytes=prefill,
                    platform=platform or jax.devices()[0].platform,
                    host_cache_bytes=staged if host_cache_gb is not None else 0,
                    store_copied=store_copied and store == "mmap")


def available_ram() -> int | None:
  """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def gb(n: int) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else mb(n)


def mb(n: int) -> str:
  return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# ------------------------------------------------- what a run really holds (measured)
def _status_kb(pid: str = "self") -> dict:
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
          out[key] = int(rest.split()[0]) * 1024
  except OSError:
    pass
  return out


def read_bytes(pid: str = "self") -> int | None:
  """Bytes this process caused to be read from storage (/proc/PID/io read_bytes)."""
  try:
    with open(f"/proc/{pid}/io") as f:
      for line in f:
        if line.startswith("read_bytes:"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def status(pid: str = "self") -> dict:
  """{rss_anon, rss_file, vm_hwm}: bytes now (VmHWM: the peak of anon + file pages)."""
  s = _status_kb(pid)
  return {"rss_anon": s.get("RssAnon"), "rss_file": s.get("RssFile"),
          "vm_hwm": s.get("VmHWM")}


class AnonWatch:
  """The peak of RssAnon, sampled every `interval_s` on a daemon thread, and the disk
  bytes read, between enter and exit (`peak_anon` also counts what was held at enter)."""

  def __init__(self, interval_s: float = 0.005, pid: str = "self"):
    self.interval_s, self.pid = interval_s, pid
    self.peak_anon = self.start_anon = self.read_bytes = None
    self._stop = threading.Event()
    self._thread = None
    self._read0 = None

  def sample(self):
    a = _status_kb(self.pid).get("RssAnon")
    if a is not None:
      self.peak_anon = a if self.peak_anon is None else max(self.peak_anon, a)
    return a

  def _loop(self):
    while not self._stop.wait(self.interval_s):
      self.sample()

  def __enter__(self):
    self.start_anon = self.sample()
    self._read0 = read_bytes(self.pid)
    self._thread = threading.Thread(target=self._loop, name="moejax-anon-watch", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.sample()
    r = read_bytes(self.pid)
    self.read_bytes = None if r is None or self._read0 is None else r - self._read0
    return False

  def as_dict(self) -> dict:
    return {"peak_anon_bytes": self.peak_anon, "start_anon_bytes": self.start_anon,
            "disk_read_bytes": self.read_bytes, **{f"{k}_bytes": v for k, v in
                                                   status(self.pid).items()}}
