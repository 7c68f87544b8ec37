"""A small safetensors reader/writer over numpy memmaps, with actionable errors.

Reading maps the file (no copy until a tensor is used).  The header's schema is
validated when the file is opened, and every problem names the file, the tensor
and the field: truncated data, a header that does not parse, a missing or
ill-typed field, an unsupported dtype, offsets that do not match the shape.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
  """A checkpoint file or tensor that cannot be used; the message names it."""


DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def _check_entry(path: str, name: str, info, n_data: int):
  """Validates one header entry's schema: dtype, shape and data_offsets, with types."""
  where = f"{path}: tensor '{name}'"
  if not isinstance(info, dict):
    raise CheckpointError(f"{where}: header entry is a {type(info).__name__}, not an object "
                          f"with dtype, shape and data_offsets")
  for field in ("dtype", "shape", "data_offsets"):
    if field not in info:
      raise CheckpointError(f"{where}: header entry lacks field '{field}' (has: "
                            f"{', '.join(sorted(map(str, info))) or 'nothing'})")
  if not isinstance(info["dtype"], str):
    raise CheckpointError(f"{where}: field 'dtype' is {info['dtype']!r}, not a string")
  if info["dtype"] not in DTYPES:
    raise CheckpointError(f"{where}: field 'dtype' is {info['dtype']!r}: unsupported (supported: "
                          f"{', '.join(DTYPES)})")
  shape = info["shape"]
  if not (isinstance(shape, list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
    raise CheckpointError(f"{where}: field 'shape' is {shape!r}, not a list of non-negative "
                          f"integers")
  off = info["data_offsets"]
  if not (isinstance(off, list) and len(off) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) for o in off)
          and 0 <= off[0] <= off[1]):
    raise CheckpointError(f"{where}: field 'data_offsets' is {off!r}, not [begin, end] with "
                          f"0 <= begin <= end")
  count = int(np.prod(shape)) if shape else 1
  if off[1] - off[0] != count * np.dtype(DTYPES[info["dtype"]]).itemsize:
    raise CheckpointError(f"{where}: field 'data_offsets' spans {off[1] - off[0]} bytes for "
                          f"shape {tuple(shape)} {info['dtype']}")
  if off[1] > n_data:
    raise CheckpointError(f"{path}: truncated file: tensor '{name}' ends at byte "
                          f"{off[1]} of the data, which has {n_data} bytes")


class SafetensorsFile:
  """Lazy view of one .safetensors file."""

  def __init__(self, path: str):
    self.path = path
    if not os.path.exists(path):
      raise CheckpointError(f"{path}: no such file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointError(f"{path}: truncated file ({size} bytes, no safetensors header)")
      (n,) = struct.unpack("<Q", head)
      if n > size - 8:
        raise CheckpointError(f"{path}: truncated or corrupt file (header claims {n} bytes, "
                              f"file has {size})")
      try:
        header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
      raise CheckpointError(f"{path}: corrupt safetensors header (a JSON "
                            f"{type(header).__name__}, not an object of tensors)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
      raise CheckpointError(f"{path}: corrupt safetensors header: '__metadata__' is not an "
                            f"object")
    for name, info in header.items():
      _check_entry(path, name, info, n_data=size - 8 - n)
    self.metadata = meta
    self.header = header
    self.data_offset = 8 + n
    self.size = size
    self._mm = None

  def keys(self):
    return self.header.keys()

  def _map(self):
    if self._mm is None:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    return self._mm

  def get(self, name: str) -> np.ndarray:
    """A read-only memmapped view of tensor `name` (copy it to own it)."""
    info = self.header.get(name)
    if info is None:
      raise CheckpointError(f"{self.path}: no tensor '{name}'")
    dt = DTYPES[info["dtype"]]                  # the header schema was checked on open
    lo, hi = info["data_offsets"]
    shape = tuple(info["shape"])
    buf = self._map()[self.data_offset + lo:self.data_offset + hi]
    return buf.view(dt).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
  arrays = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
  for name, a in arrays.items():
    if a.dtype not in NAMES:
      raise CheckpointError(f"cannot save tensor '{name}' of dtype {a.dtype}")
  write_streamed(path, [(n, a.dtype, a.shape) for n, a in arrays.items()],
                 lambda name: [arrays[name]], metadata)


def write_streamed(path: str, specs, chunks, metadata: dict | None = None, align: int = 1,
                   on_bytes=None):
  """Writes a safetensors file tensor by tensor, never holding more than one chunk.

  specs: [(name, dtype, shape)] in file order; chunks(name) -> an iterable of arrays
  whose bytes, in order, are the tensor's (e.g. one expert at a time).  align > 1:
  the data section and every tensor start at a multiple of `align` bytes from the
  file's start (page-aligned tensors can be mapped and handed to jax without a copy);
  the gaps are zeros, which this module's reader accepts.  on_bytes(n): progress.
  The file is written to `path + '.part'` and renamed when complete, so an interrupted
  write leaves no file that looks whole."""
  header, off = {}, 0
  for name, dt, shape in specs:
    dt = np.dtype(dt)
    if dt not in NAMES:
      raise CheckpointError(f"cannot save tensor '{name}' of dtype {dt}")
    n = int(np.prod(shape)) * dt.itemsize
    header[name] = {"dtype": NAMES[dt], "shape": [int(d) for d in shape],
                    "data_offsets": [off, off + n]}
    off += n + (-n % align)
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-(len(raw) + 8) % max(8, align))
  part = path + ".part"
  with open(part, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name, dt, shape in specs:
      lo, hi = header[name]["data_offsets"]
      written = 0
      for c in chunks(name):
        b = np.ascontiguousarray(c).view(np.uint8).reshape(-1)
        f.write(memoryview(b))
        written += b.size
        if on_bytes:
          on_bytes(b.size)
      if written != hi - lo:
        raise CheckpointError(f"{path}: tensor '{name}' got {written} bytes, expected {hi - lo}")
      if -(hi - lo) % align:
        f.write(b"\0" * (-(hi - lo) % align))
  os.replace(part, path)
