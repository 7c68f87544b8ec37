"""The block formats moejax reads and writes, as ggml defines them (ggml-common.h).

A quantized weight [..., O, C] (C the dot axis, a multiple of the block size) is GGUF's raw
block bytes, row-major: uint8 [..., O, C / block * type_size].  Per block:

  q8_0  32 values,  34 bytes: f16 d, 32 int8 q;                      w = q * d
  q4_0  32 values,  18 bytes: f16 d, 16 bytes, value j in the low nibble of byte j and
                              value j + 16 in its high nibble;       w = (code - 8) * d
  q4_k  256 values, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8
                              sub-blocks of 32, 128 bytes of 4-bit codes (a 64-value
                              chunk: values 0-31 low nibbles, 32-63 high nibbles);
                              w = d * sc * code - dmin * m
  q6_k  256 values, 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8
                              scales (sub-blocks of 16), f16 d;      w = d * sc * (code - 32)

`GGML_TYPE` is each format's number in a GGUF file (ggml.h's enum ggml_type); F32, F16 and
BF16 are the float types a GGUF tensor may also have.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Format:
  name: str          # "q8_0", ...: the --weights value and QuantArray.qtype
  block: int         # values per block
  type_size: int     # bytes per block
  ggml_type: int     # enum ggml_type (the GGUF tensor type)

  def row_bytes(self, c: int) -> int:
    """Bytes of a row of c values (c a multiple of `block`)."""
    return c // self.block * self.type_size

  def values(self, nbytes: int) -> int:
    """Values in a row of nbytes bytes."""
    return nbytes // self.type_size * self.block


FORMATS = {f.name: f for f in (Format("q8_0", 32, 34, 8), Format("q4_0", 32, 18, 2),
                               Format("q4_k", 256, 144, 12), Format("q6_k", 256, 210, 14))}
QTYPES = tuple(FORMATS)
FLOAT_GGML_TYPES = {0: "f32", 1: "f16", 30: "bf16"}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}


class FormatError(ValueError):
  """A block format moejax does not know, or a row it cannot be cut into blocks."""


def get(qtype: str) -> Format:
  try:
    return FORMATS[qtype]
  except KeyError:
    raise FormatError(f"unknown block format {qtype!r}; moejax knows {', '.join(QTYPES)}") \
        from None


def check_row(qtype: str, c: int, what: str = "the weight"):
  """A FormatError naming `what` unless rows of c values cut into `qtype`'s blocks."""
  f = get(qtype)
  if c % f.block:
    raise FormatError(f"{what}: rows of {c} values are not a multiple of {qtype}'s block "
                      f"of {f.block}")
