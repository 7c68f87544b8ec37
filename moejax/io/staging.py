"""The host staging tier (`--store=mmap --host_cache_gb=G`): a bounded cache of whole
experts in host memory, fed from the mapped store, for a model larger than the host's RAM
on an accelerator (docs/engine.md "Memory tiers").

  cache = StagingCache(store, capacity_bytes)       # store: an mmap ExpertStore
  rows = cache.read(layer, e)     # {name: [1, ...]}: staged, or read from the file + admitted
  cache.counts()                  # staged reads, disk reads, disk bytes and seconds

The decode program reads an expert it copies into a slot through `Staged.rows`, a host
callback (`jax.experimental.io_callback`) inside the program's copy loop, so one program
per token is kept and the token's time includes every wait on the disk.  The pool is
`rows` whole experts over all MoE layers, allocated once (`rows` x one expert's bytes:
exactly the plan's "host staging"); a (layer, expert) holds at most one row.  Admission
is by frequency, as the device cache's lfu: every read adds one to the expert's decayed
count; a miss takes a free row, else replaces the staged expert with the smallest count
if its own count is larger (else it is read and not kept).  16-bit floats are held as
their uint16 bits, as `io.placement.program_store` hands them to the program.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time

import jax
from jax.experimental import io_callback
import numpy as np

from moejax.io import pages
from moejax.io.store import (StoreBackendError, align_hint, store_backend,
                             unaligned_bytes)

FLAG = "--host_cache_gb"


class StagingError(StoreBackendError):
  """A host staging size or store that cannot work; the message names --host_cache_gb."""


def smallest_gb(expert_bytes: int, num_moe_layers: int) -> float:
  """The smallest --host_cache_gb that holds one expert per MoE layer (GB = 10^9 bytes,
  rounded up to 0.01)."""
  return math.ceil(expert_bytes * num_moe_layers / 1e7) / 100


def staging_rows(gb: float, expert_bytes: int, num_moe_layers: int, store: str = "mmap") -> int:
  """Whole experts `gb` GB holds, checked: at least one per MoE layer, with --store=mmap."""
  if store != "mmap":
    raise StagingError(f"{FLAG} stages experts read from the mapped checkpoint: it needs "
                       f"--store=mmap (got --store={store})")
  rows = round(gb * 1e9) // expert_bytes if gb > 0 else 0
  if rows < num_moe_layers:
    raise StagingError(f"{FLAG}={gb:g} holds {rows} experts of {expert_bytes / 1e6:.2f} MB; "
                       f"the smallest that works is {FLAG}="
                       f"{smallest_gb(expert_bytes, num_moe_layers):.2f} (one expert per MoE "
                       f"layer x {num_moe_layers} layers)")
  return rows


def size_bytes(gb: float | None) -> int | None:
  """--host_cache_gb in bytes (None: off)."""
  return None if gb is None else round(gb * 1e9)


def describe(c: dict) -> str:
  """One line of `StagingCache.counts`: the reads since the engine was built."""
  return (f"{c['staged_reads']} expert reads staged, {c['disk_reads']} from disk "
          f"({c['disk_bytes'] / 1e9:.2f} GB in {c['disk_s']:.2f} s); hit rate "
          f"{c['staging_hit_rate']:.1%}; {c['staging_held']}/{c['staging_rows']} rows held")


def _bits(a: np.ndarray) -> np.ndarray:
  return a.view(np.uint16) if a.dtype.itemsize == 2 and a.dtype.kind in "fV" else a


class Admission:
  """Which keys (layer index x E + expert) `rows` rows hold, by frequency: `touch` adds one
  to the key's count (all counts decay by `decay` a touch) and answers whether it is held,
  or the row it now takes (a free one, else the held key with the smallest count if that
  count is smaller than its own; None: not kept).  No data: `StagingCache` holds the rows,
  `replay` counts what a sequence of reads would find."""

  def __init__(self, rows: int, num_keys: int, decay: float = 0.999):
    self.rows, self.decay = rows, decay
    self.freq = np.zeros(num_keys)
    self.key_of = np.full(rows, -1, np.int64)      # row -> key
    self.row_of = {}                               # key -> row

  def touch(self, key: int) -> tuple[bool, int | None]:
    if not self.rows:                              # read-through: nothing is kept
      return False, None
    self.freq *= self.decay
    self.freq[key] += 1.0
    row = self.row_of.get(key)
    if row is not None:
      return True, row
    free = np.flatnonzero(self.key_of < 0)
    if free.size:
      row = int(free[0])
    else:
      row = int(np.argmin(self.freq[self.key_of]))
      if self.freq[self.key_of[row]] >= self.freq[key]:
        return False, None                         # read, not kept
      del self.row_of[int(self.key_of[row])]
    self.key_of[row], self.row_of[key] = key, row
    return False, row


def replay(keys, rows: int, num_keys: int, decay: float = 0.999) -> tuple[int, int]:
  """(reads a tier of `rows` would have served, reads) for a sequence of keys."""
  adm, hits, n = Admission(rows, num_keys, decay), 0, 0
  for k in keys:
    hits += adm.touch(int(k))[0]
    n += 1
  return hits, n


class StagingCache:
  """`rows` experts of a mapped store held in host memory (see the module docstring);
  capacity_bytes None: no rows, every read a copy from the mapped file (`read_through`)."""

  def __init__(self, store, capacity_bytes: int | None, decay: float = 0.999):
    if store_backend(store) != "mmap":
      raise StagingError(f"{FLAG} stages experts read from the mapped checkpoint: it needs "
                         f"--store=mmap (got a {store_backend(store)} store)")
    self.layers = tuple(store.moe_layers)
    self.expert_bytes = store.expert_nbytes()
    self.rows = (0 if capacity_bytes is None else
                 staging_rows(capacity_bytes / 1e9, self.expert_bytes, len(self.layers)))
    self._src = {l: {k: _bits(np.asarray(v)) for k, v in store.stacked(l).items()}
                 for l in self.layers}
    # per layer: a GGUF's layers may hold their experts in different formats (Q4_K_M)
    self.specs = {l: {k: (v.shape[1:], v.dtype) for k, v in src.items()}
                  for l, src in self._src.items()}
    self.spec = self.specs[self.layers[0]]
    self.num_experts = next(iter(self._src[self.layers[0]].values())).shape[0]
    if self.rows and any(s != self.spec for s in self.specs.values()):
      other = next(l for l in self.layers if self.specs[l] != self.spec)
      raise StagingError(f"{FLAG}: the staging rows hold experts of one format, and this "
                         f"store's MoE layers mix them (layer {self.layers[0]}: "
                         f"{', '.join(self.spec)}; layer {other}: "
                         f"{', '.join(self.specs[other])}); drop {FLAG}")
    self.pool = {k: np.empty((self.rows,) + s, d) for k, (s, d) in self.spec.items()}
    self._index = {l: i for i, l in enumerate(self.layers)}
    self.admission = Admission(self.rows, len(self.layers) * self.num_experts, decay)
    self.staged_reads = self.disk_reads = self.disk_bytes = 0
    self.disk_s = 0.0
    self._lock = threading.Lock()

  @property
  def nbytes(self) -> int:
    return self.rows * self.expert_bytes

  def held(self) -> int:
    """Experts staged now (never more than `rows`)."""
    return len(self.admission.row_of)

  def staged(self, layer: int) -> list[int]:
    i = self._index[layer]
    return sorted(k - i * self.num_experts for k in self.admission.row_of
                  if k // self.num_experts == i)

  def read(self, layer: int, e: int) -> dict:
    """Expert e of `layer` as {name: [1, ...]}: on a hit, views of its pool row (the
    runtime copies a callback's results into the program's buffers as the callback
    returns, before the program's next read can replace the row; measured: one copy less
    made a staged copy 1.5x a mapped slice instead of 2.2-3.6x)."""
    e = int(e)
    key = self._index[int(layer)] * self.num_experts + e
    with self._lock:
      staged, row = self.admission.touch(key)
      if staged:
        self.staged_reads += 1
        return {k: p[row:row + 1] for k, p in self.pool.items()}   # copied by the runtime
      t0 = time.perf_counter()
      blocks = {k: v[e:e + 1] for k, v in self._src[int(layer)].items()}
      for b in blocks.values():   # read together and exactly, not fault by fault
        pages.will_need(b)
      out = {k: np.array(b) for k, b in blocks.items()}
      self.disk_s += time.perf_counter() - t0
      self.disk_reads += 1
      self.disk_bytes += self.expert_bytes
      if row is not None:
        for k, p in self.pool.items():
          p[row] = out[k][0]
      return out

  def counts(self) -> dict:
    """Reads since built: staged_reads from the pool, disk_reads of the mapped file (the
    page cache may still serve one: `disk_s` says what they cost), their bytes."""
    n = self.staged_reads + self.disk_reads
    return {"staged_reads": self.staged_reads, "disk_reads": self.disk_reads,
            "staging_hit_rate": self.staged_reads / n if n else 0.0,
            "disk_bytes": self.disk_bytes, "disk_s": self.disk_s,
            "staging_rows": self.rows, "staging_held": self.held()}


def read_through(store, platform: str):
  """A StagingCache without rows (each fetch a copy of the expert from the mapped file)
  for a mapped store that jax's CPU client cannot wrap in place: a GGUF whose tensor data
  starts at 32 mod 64 bytes, as llama.cpp writes them.  Handed to the program, such a
  store would be copied whole into RAM (`io.placement.program_store`), against the
  memory plan's "page cache"; read through, a miss costs one copy of one expert.  One
  line on stderr says so and how to align the file.  None for any other store."""
  unaligned = unaligned_bytes(store) if platform == "cpu" else 0
  if store_backend(store) != "mmap" or not unaligned:
    return None
  print(f"[moejax] {getattr(store, 'path', 'the mapped expert store')}: "
        f"{unaligned / 1e9:.2f} GB of experts start off jax's 64-byte alignment, so they "
        f"cannot be mapped in place: each fetched expert is read from the file (a copy per "
        f"fetch) instead of the whole store copied into RAM{align_hint(store)}",
        file=sys.stderr)
  return StagingCache(store, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Staged:
  """A MoE layer's experts as the decode program reads them through the staging cache: a
  pytree without leaves (the cache and layer are static: part of the program's key)."""
  cache: StagingCache = dataclasses.field(metadata=dict(static=True))
  layer: int = dataclasses.field(metadata=dict(static=True))

  def __eq__(self, other):
    return isinstance(other, Staged) and (self.cache, self.layer) == (other.cache, other.layer)

  def __hash__(self):
    return hash((id(self.cache), self.layer))

  def rows(self, e) -> dict:
    """Expert e (a traced int32) as {name: [1, ...]} on the device, from the host callback."""
    shapes = {k: jax.ShapeDtypeStruct((1,) + s, d)
              for k, (s, d) in self.cache.specs[self.layer].items()}
    return io_callback(
        lambda i: self.cache.read(self.layer, i), shapes, e, ordered=False)
