"""The quality fit of auto-tuning: a predicted perplexity increase (%) from the quality
proxy (substituted + dropped gate mass), calibrated on emulated points: a monotone
(isotonic) piecewise-linear curve through (0, 0) and the measured (mass, dPPL) pairs,
extrapolated with its last segment's slope (`moejax.research.autotune` uses it).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def isotonic(y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
  """The non-decreasing sequence closest to y in weighted least squares (pool adjacent
  violators)."""
  y = np.asarray(y, float)
  w = np.ones_like(y) if w is None else np.asarray(w, float)
  blocks = []   # [mean, weight, count]
  for v, wt in zip(y, w):
    blocks.append([v, wt, 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      m2, w2, c2 = blocks.pop()
      m1, w1, c1 = blocks.pop()
      blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
  return np.concatenate([np.full(c, m) for m, _, c in blocks])


@dataclasses.dataclass(frozen=True)
class QualityFit:
  """Predicted perplexity increase (%) from the quality proxy (substituted mass)."""
  mass: tuple           # knots, increasing, starting at 0
  dppl: tuple           # fitted values at the knots (non-decreasing, 0 at mass 0)
  r: float | None       # Pearson r of the measured anchors (mass vs dPPL)
  anchors: int

  def predict(self, mass) -> np.ndarray:
    x, y = np.asarray(self.mass), np.asarray(self.dppl)
    m = np.asarray(mass, float)
    out = np.interp(m, x, y)
    if len(x) > 1:   # the last segment's slope, at least the mean slope (a convex curve)
      slope = max((y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-12), y[-1] / max(x[-1], 1e-12), 0.0)
      out = np.where(m > x[-1], y[-1] + slope * (m - x[-1]), out)
    return out

  def describe(self) -> str:
    r = "n/a" if self.r is None else f"{self.r:.2f}"
    return (f"isotonic piecewise-linear dPPL(mass) through {self.anchors} emulated points "
            f"(Pearson r {r})")


def fit_quality(mass, dppl) -> QualityFit:
  """The fit through (0, 0) and the measured (mass, dPPL) pairs (ties at one mass
  averaged; measurements at mass 0 pinned to 0)."""
  mass, dppl = np.asarray(mass, float), np.asarray(dppl, float)
  keep = mass > 0
  r = (float(np.corrcoef(mass, dppl)[0, 1]) if len(mass) >= 3 and np.std(mass) > 0
       and np.std(dppl) > 0 else None)
  xs, inv = np.unique(mass[keep], return_inverse=True)
  ys = np.bincount(inv, dppl[keep]) / np.bincount(inv) if len(xs) else np.zeros(0)
  ws = np.bincount(inv).astype(float) if len(xs) else np.zeros(0)
  # the origin is exact (nothing substituted: the model's own output); weight it heavily
  x = np.concatenate([[0.0], xs])
  y = isotonic(np.concatenate([[0.0], ys]), np.concatenate([[1e6], ws]))
  return QualityFit(tuple(x.tolist()), tuple(y.tolist()), r, int(keep.sum()))
