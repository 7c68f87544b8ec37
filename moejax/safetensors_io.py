"""A small safetensors reader/writer over numpy memmaps, with actionable errors.

Reading maps the file (no copy until a tensor is used); every problem names the
file and the tensor: truncated data, a header that does not parse, an
unsupported dtype.
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
    self.metadata = header.pop("__metadata__", None) or {}
    self.header = header
    self.data_offset = 8 + n
    self.size = size
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if self.data_offset + end > size:
      bad = [k for k, v in header.items() if self.data_offset + v["data_offsets"][1] > size]
      raise CheckpointError(f"{path}: truncated file: tensor '{sorted(bad)[0]}' ends at byte "
                            f"{self.data_offset + end}, file has {size} bytes")
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
    dt = DTYPES.get(info["dtype"])
    if dt is None:
      raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype "
                            f"{info['dtype']} (supported: {', '.join(DTYPES)})")
    lo, hi = info["data_offsets"]
    shape = tuple(info["shape"])
    count = int(np.prod(shape)) if shape else 1
    if hi - lo != count * np.dtype(dt).itemsize:
      raise CheckpointError(f"{self.path}: tensor '{name}' has {hi - lo} bytes for shape "
                            f"{shape} {info['dtype']}")
    buf = self._map()[self.data_offset + lo:self.data_offset + hi]
    return buf.view(dt).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
  header, off, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in NAMES:
      raise CheckpointError(f"cannot save tensor '{name}' of dtype {a.dtype}")
    header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [off, off + a.nbytes]}
    off += a.nbytes
    arrays.append(a)
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
