"""The numpy reference of the GGUF block kernels' tests (test_cpu_quant.py): random valid
blocks, ggml's dequantizers, the kernels' 8-bit activation rounding and its error bound."""

import numpy as np

BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_k": (256, 144), "q6_k": (256, 210)}


def _f16(rng, n, lo, hi):
  """n random f16 scales of magnitude in [lo, hi), either sign, as bytes [n, 2]."""
  v = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
  return v.astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(rng, qtype, rows, cols):
  """Valid GGUF blocks [rows, cols / bs * size] of random codes and scales (values of
  order 1); any bytes are valid codes."""
  bs, size = BLOCK[qtype]
  n = rows * cols // bs
  raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
  if qtype == "q8_0":
    raw[:, :2] = _f16(rng, n, 0.002, 0.01)
  elif qtype == "q4_0":
    raw[:, :2] = _f16(rng, n, 0.05, 0.2)
  elif qtype == "q4_k":
    raw[:, :2] = np.abs(_f16(rng, n, 1e-3, 3e-3).view(np.float16)).view(np.uint8)
    raw[:, 2:4] = np.abs(_f16(rng, n, 1e-3, 3e-3).view(np.float16)).view(np.uint8)
  else:
    raw[:, 208:210] = _f16(rng, n, 1e-4, 4e-4)
  return raw.reshape(rows, cols // bs * size)


def _half(b, at):
  return b[:, at:at + 2].copy().view(np.float16).astype(np.float64)[:, 0]


def dequantize(blocks, qtype):
  """[rows, B] blocks -> [rows, C] float64 weights, as ggml-quants.c's dequantize_row_*."""
  bs, size = BLOCK[qtype]
  rows = blocks.shape[0]
  b = blocks.reshape(-1, size)
  if qtype == "q8_0":
    v = _half(b, 0)[:, None] * b[:, 2:].view(np.int8)
  elif qtype == "q4_0":
    qs = b[:, 2:].astype(np.int64)
    v = _half(b, 0)[:, None] * (np.concatenate([qs & 15, qs >> 4], axis=1) - 8)
  elif qtype == "q4_k":
    s = b[:, 4:16].astype(np.int64)
    sc = np.concatenate([s[:, :4] & 63, (s[:, 8:] & 15) | ((s[:, :4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, 16:].astype(np.int64).reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)   # sub-blocks 2c, 2c + 1
    v = (_half(b, 0)[:, None, None] * sc[:, :, None] * q
         - _half(b, 2)[:, None, None] * mn[:, :, None])
  else:
    ql = b[:, :128].astype(np.int64).reshape(-1, 2, 64)
    qh = b[:, 128:192].astype(np.int64).reshape(-1, 2, 32)
    lo = np.concatenate([ql & 15, ql >> 4], axis=2)                     # [n, 2, 128]
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [n, 2, 128]
    q = ((lo | (hi << 4)) - 32).reshape(-1, 16, 16)
    sc = b[:, 192:208].view(np.int8).astype(np.int64)
    v = _half(b, 208)[:, None, None] * sc[:, :, None] * q
  return v.reshape(rows, -1)


def quantize_act(x, bs):
  """The kernels' activation rounding in f32: per block d = max|x| / 127, codes
  round-half-even(x * (127 / max|x|)). Returns the dequantized rows (float64)."""
  xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, bs)
  amax = np.abs(xb).max(axis=-1, keepdims=True)
  with np.errstate(divide="ignore"):
    inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
  q = np.clip(np.rint(xb * inv), -127, 127)
  return (q * (amax / np.float32(127)).astype(np.float32)).astype(np.float64).reshape(x.shape)


def act_bound(x, w, bs):
  """|x . w - kernel| for every (token, row): the activation's rounding, half a step of
  each block's scale (max|x_block| / 127) times the block's sum |w|."""
  xb = np.abs(np.asarray(x, np.float64)).reshape(x.shape[0], -1, bs).max(axis=-1)
  wb = np.abs(w).reshape(w.shape[0], -1, bs).sum(axis=-1)
  return 0.5 / 127 * xb @ wb.T


def ref_linear(x, blocks, qtype):
  """(exact x @ w.T, x as the kernel rounds it @ w.T), float64."""
  w, bs = dequantize(blocks, qtype), BLOCK[qtype][0]
  x64 = np.asarray(x, np.float64)
  return x64 @ w.T, quantize_act(x64, bs) @ w.T
