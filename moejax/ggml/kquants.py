"""Q4_K and Q6_K on the host (numpy, f32), after ggml's `quantize_row_q4_K_ref` and
`quantize_row_q6_K_ref` (ggml-quants.c, without an importance matrix), vectorized over
blocks: the same searches (`make_qkx2_quants`: 21 trial scales per sub-block of 32 with a
least-squares scale and min; `make_qx_quants`: 19 trial scales per sub-block of 16), the
same 6-bit (Q4_K) and 8-bit (Q6_K) quantization of the sub-block scales against an f16
super-block scale, the same rounding (`nearest_int`: half to even) and packing.  numpy sums
in another order than the C loops, so a rare tie may pick another trial scale than
llama-quantize would; the bytes stay valid blocks, checked against gguf-py's dequantizer
and error bounds in tests/test_ggml.py.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
_EPS = np.float32(1e-15)    # GROUP_MAX_EPS
F = np.float32


def _sum(a):
  return a.sum(axis=1, dtype=np.float32)


def _qkx2(x_NxG, w_NxG, nmax: int, rmin: float, rdelta: float, nstep: int):
  """make_qkx2_quants (use_mad false) per row: (scale [N], -min [N], codes [N, G])."""
  lo = np.minimum(x_NxG.min(axis=1), F(0))
  hi = x_NxG.max(axis=1)
  flat = hi == lo
  span = np.where(flat, F(1), hi - lo)
  sum_w, sum_x = _sum(w_NxG), _sum(w_NxG * x_NxG)
  iscale = F(nmax) / span
  scale = F(1) / iscale
  codes = lambda s, m: np.clip(np.rint(s[:, None] * (x_NxG - m[:, None])), 0, nmax).astype(F)
  err = lambda s, m, l: _sum(w_NxG * np.square(s[:, None] * l + m[:, None] - x_NxG))
  L = codes(iscale, lo)
  best = err(scale, lo, L)
  for i in range(nstep + 1):
    la = codes((F(rmin) + F(rdelta) * F(i) + F(nmax)) / span, lo)
    sl, sl2, sxl = _sum(w_NxG * la), _sum(w_NxG * la * la), _sum(w_NxG * la * x_NxG)
    det = sum_w * sl2 - sl * sl
    ok = det > 0
    det = np.where(ok, det, F(1))
    s = (sum_w * sxl - sum_x * sl) / det
    m = (sl2 * sum_x - sl * sxl) / det
    pos = m > 0
    m = np.where(pos, F(0), m)
    s = np.where(pos, sxl / np.where(sl2 > 0, sl2, F(1)), s)
    e = err(s, m, la)
    up = ok & (e < best)
    L, best = np.where(up[:, None], la, L), np.where(up, e, best)
    scale, lo = np.where(up, s, scale), np.where(up, m, lo)
  scale = np.where(flat, F(0), scale)
  return scale, -lo, np.where(flat[:, None], F(0), L)


def _f16(v):
  return v.astype(np.float16)


def _f16_bytes(v):
  return _f16(v).view(np.uint8).reshape(-1, 2)


def _u8(v):
  """nearest_int(v) stored in a uint8_t (C's wrap-around)."""
  return (np.rint(v).astype(np.int64) & 0xFF).astype(np.uint8)


def q4_k_blocks(x_Nx256):
  n = x_Nx256.shape[0]
  xs = x_Nx256.reshape(n * 8, 32)
  av = np.sqrt(_sum(xs * xs) / F(32))
  with np.errstate(divide="ignore", invalid="ignore"):
    scales, mins, L = _qkx2(xs, av[:, None] + np.abs(xs), 15, -1.0, 0.1, 20)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), F(0))
    max_min = np.maximum(mins.max(axis=1), F(0))
    inv_s = np.where(max_scale > 0, F(63) / max_scale, F(0))
    inv_m = np.where(max_min > 0, F(63) / max_min, F(0))
    ls = np.minimum(_u8(inv_s[:, None] * scales), 63)
    lm = np.minimum(_u8(inv_m[:, None] * mins), 63)
    d, dmin = _f16(max_scale / F(63)), _f16(max_min / F(63))
    dq = d.astype(F)[:, None] * ls.astype(F)
    dm = dmin.astype(F)[:, None] * lm.astype(F)
    safe = np.where(dq == 0, F(1), dq)
    req = np.clip(np.rint((x_Nx256.reshape(n, 8, 32) + dm[..., None]) / safe[..., None]), 0, 15)
  L = np.where((dq == 0)[..., None], L, req).astype(np.uint8).reshape(n, 4, 2, 32)
  sc = np.zeros((n, 12), np.uint8)
  sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
  sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
  sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
  qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
  return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), sc, qs], axis=1)


def q4_k_scales(sc_Nx12):
  """(sc, m) uint8 [N, 8] of Q4_K's packed 6-bit scales (get_scale_min_k4)."""
  s = sc_Nx12
  sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
  m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
  return sc, m


def q4_k_values(b_Nx144):
  n = b_Nx144.shape[0]
  d = np.ascontiguousarray(b_Nx144[:, 0:2]).view(np.float16).astype(F)
  dmin = np.ascontiguousarray(b_Nx144[:, 2:4]).view(np.float16).astype(F)
  sc, m = q4_k_scales(b_Nx144[:, 4:16])
  q = b_Nx144[:, 16:].reshape(n, 4, 1, 32)
  codes = np.concatenate([q & 0xF, q >> 4], axis=2).reshape(n, 8, 32).astype(F)
  return ((d * sc.astype(F))[..., None] * codes
          - (dmin * m.astype(F))[..., None]).reshape(n, QK_K)


def _qx(x_NxG, nmax: int):
  """make_qx_quants(rmse_type 1, no weights) per row: (scale [N], codes [N, G] + nmax)."""
  i = np.abs(x_NxG).argmax(axis=1)
  top = np.take_along_axis(x_NxG, i[:, None], axis=1)[:, 0]
  zero = np.abs(top) < _EPS
  top = np.where(zero, F(1), top)
  w = x_NxG * x_NxG

  def trial(iscale):
    l = np.clip(np.rint(iscale[:, None] * x_NxG), -nmax, nmax - 1).astype(F)
    return l, _sum(w * x_NxG * l), _sum(w * l * l)

  l, slx, sl2 = trial(-F(nmax) / top)
  scale = np.where(sl2 != 0, slx / np.where(sl2 != 0, sl2, F(1)), F(0))
  best, L = scale * slx, l
  for k in range(-9, 10):
    if k == 0:
      continue
    l, slx, sl2 = trial(-(F(nmax) + F(0.1) * F(k)) / top)
    up = (sl2 > 0) & (slx * slx > best * sl2)
    s = slx / np.where(sl2 > 0, sl2, F(1))
    L, scale = np.where(up[:, None], l, L), np.where(up, s, scale)
    best = np.where(up, scale * slx, best)
  return np.where(zero, F(0), scale), np.where(zero[:, None], F(0), L + nmax)


def q6_k_blocks(x_Nx256):
  n = x_Nx256.shape[0]
  with np.errstate(divide="ignore", invalid="ignore"):
    scales, L = _qx(x_Nx256.reshape(n * 16, 16), 32)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    i = np.abs(scales).argmax(axis=1)
    top = np.take_along_axis(scales, i[:, None], axis=1)[:, 0]
    zero = np.abs(top) < _EPS
    iscale = F(-128) / np.where(zero, F(1), top)
    d = _f16(F(1) / iscale)
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
    dq = d.astype(F)[:, None] * sc.astype(F)
    safe = np.where(dq == 0, F(1), dq)
    req = np.clip(np.rint(x_Nx256.reshape(n, 16, 16) / safe[..., None]), -32, 31) + 32
  L = np.where((dq == 0)[..., None], L, req).astype(np.uint8).reshape(n, 2, 4, 32)
  ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                       (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2)
  qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
        | ((L[:, :, 3] >> 4) << 6))
  out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                        _f16_bytes(d)], axis=1)
  out[zero] = 0                   # an all-zero block: every byte 0 (memset), d = +0
  return out


def q6_k_values(b_Nx210):
  n = b_Nx210.shape[0]
  ql = b_Nx210[:, :128].reshape(n, 2, 1, 64)
  qh = b_Nx210[:, 128:192].reshape(n, 2, 1, 32)
  sc = b_Nx210[:, 192:208].view(np.int8).astype(F)
  d = np.ascontiguousarray(b_Nx210[:, 208:210]).view(np.float16).astype(F)
  lo = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(n, 2, 4, 32)
  hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=2)
  codes = (lo | (hi << 4)).astype(F) - 32
  return ((d * sc)[..., None] * codes.reshape(n, 16, 16)).reshape(n, QK_K)
