"""`moejax-align-gguf`: a GGUF's tensor data moved to a 64-byte boundary, so that jax maps it.

llama.cpp pads a GGUF's data section to 32 bytes (general.alignment), so in most files
its tensors start at 32 mod 64 bytes.  jax's CPU client wraps host memory in place only at
64-byte alignment (`io.repack.JAX_ALIGN`): such a file's experts cannot be handed to a
program without a copy.  The offload engine then reads each expert it fetches from the
file (`io.staging.read_through`: a copy per fetch, none of the whole file); every expert
resident copies them into RAM (one warning line, `ExpertStore.device_experts`).  `align`
rewrites the file once, so that both map it in place.

`align` adds one string key ("moejax.pad") at the end of the metadata, before the tensor
index, and shifts everything after it by its size (a multiple of general.alignment): tensor
offsets count from the data section, so nothing else changes, and llama.cpp reads the
file as before.  In place it moves the bytes back to front (nothing is overwritten before
it is read; an interrupted rewrite leaves the file unreadable); with `out`, it writes
out + ".part" and renames it.
"""

from __future__ import annotations

import os

from moejax.io.repack import JAX_ALIGN as ALIGN

PAD_KEY = "moejax.pad"
_CHUNK = 64 << 20


def _reader(path: str):
  from moejax.io.weights.gguf_file import _reader as reader
  return reader(path)


def offset(path: str, to: int = ALIGN) -> int:
  """Where the file's data section starts, mod `to` (0: mapped in place)."""
  return _reader(path).data_offset % to


def copied_whole(path: str | None, store: str, policy: str | None) -> bool:
  """Whether a run copies the GGUF at `path`'s experts whole into RAM (its memory plan
  counts them, `offload.memory.plan_memory(store_copied=...)`): mapped (--store=mmap) off
  the 64-byte boundary with every expert resident (no --policy) or --policy=host, which
  hand the mapped store to the program. Other policies read each fetched expert from the
  file (`io.staging.read_through`); other stores copy it anyway, as their plans say."""
  return (path is not None and path.endswith(".gguf") and store == "mmap"
          and policy in (None, "host") and offset(path) != 0)


def _layout(path: str, to: int) -> tuple[int, int, bytes]:
  """(the end of the metadata, the number of keys, the pad key's bytes: b"" if aligned)."""
  r = _reader(path)
  shift = -r.data_offset % to
  fields = [f for k, f in r.fields.items() if not k.startswith("GGUF.")]
  kv_end = max(f.offset + sum(int(p.nbytes) for p in f.parts) for f in fields)
  n_kv, step = len(fields), r.alignment
  del r, fields
  if shift == 0:
    return kv_end, n_kv, b""
  if shift % step:
    raise ValueError(f"{path}: its data section is at {step}-byte alignment (general."
                     f"alignment) and cannot move by {shift} bytes to reach {to}")
  head = 8 + len(PAD_KEY) + 4 + 8             # key length, key, value type, value length
  while shift < head:
    shift += to
  value = b" " * (shift - head)
  kv = (len(PAD_KEY).to_bytes(8, "little") + PAD_KEY.encode() + (8).to_bytes(4, "little")
        + len(value).to_bytes(8, "little") + value)       # GGUF value type 8: a string
  return kv_end, n_kv, kv


def align(path: str, to: int = ALIGN, out: str | None = None) -> int:
  """Moves `path`'s data section to a multiple of `to` bytes: in place, or (out) into a
  new file.  -> the bytes it moved by (0: already aligned; `out` is then a plain copy)."""
  kv_end, n_kv, kv = _layout(path, to)
  if out is not None and os.path.abspath(out) != os.path.abspath(path):
    _copy(path, out, kv_end, n_kv, kv)
    return len(kv)
  if not kv:
    return 0
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    end = size
    while end > kv_end:                       # back to front: nothing overwritten unread
      start = max(kv_end, end - _CHUNK)
      f.seek(start)
      buf = f.read(end - start)
      f.seek(start + len(kv))
      f.write(buf)
      end = start
    f.seek(kv_end)
    f.write(kv)
    f.seek(16)                                # after the magic, version and tensor count
    f.write((n_kv + 1).to_bytes(8, "little"))
  return len(kv)


def _copy(path: str, out: str, kv_end: int, n_kv: int, kv: bytes):
  part = out + ".part"
  try:
    with open(path, "rb") as src, open(part, "wb") as dst:
      head = bytearray(src.read(kv_end))
      if kv:
        head[16:24] = (n_kv + 1).to_bytes(8, "little")
      dst.write(head + kv)
      while buf := src.read(_CHUNK):
        dst.write(buf)
    os.replace(part, out)
  finally:
    if os.path.exists(part):
      os.remove(part)
