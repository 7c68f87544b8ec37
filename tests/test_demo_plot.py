"""moejax-demo's figure stays readable when the presets' perplexity increases span
decades: a symmetric-log axis, and labels that cover neither each other nor a point."""

import pytest

from moejax.cli.demo_plot import plot

# docs/demo_output.txt: (ms/token, perplexity increase %, substituted mass)
ROWS = {"baseline": (5.17, 0.0, 0.0), "quality": (4.31, 7.42, 0.072),
        "speed": (4.31, 26.45, 0.097), "host": (4.89, 0.0, 0.0),
        "substitute_all": (1.69, 7387.07, 0.395)}


def rows(with_ppl=True):
  return {k: dict(tpot_ms=t, ppl_increase_pct=p if with_ppl else None,
                  substituted_mass_per_token_layer=m) for k, (t, p, m) in ROWS.items()}


def boxes(fig, ax):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  FigureCanvasAgg(fig)                 # plot() closed the figure: a canvas to measure on
  fig.canvas.draw()
  r = fig.canvas.get_renderer()
  labels = {t.get_text().split(" ")[0]: t.get_window_extent(r) for t in ax.texts}
  from matplotlib.transforms import Bbox
  points = []
  for c in ax.collections:                     # each marker: 6 pt across (s=36)
    (px, py), = ax.transData.transform(c.get_offsets())
    half = 3 * fig.dpi / 72
    points.append(Bbox([[px - half, py - half], [px + half, py + half]]))
  assert len(points) == len(ROWS)
  return labels, points


@pytest.mark.parametrize("with_ppl", [True, False])
def test_labels_cover_no_other_label_and_no_point(tmp_path, with_ppl):
  fig, ax = plot(rows(with_ppl), str(tmp_path / "demo.png"), "title", "emulator")
  assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
  labels, points = boxes(fig, ax)
  assert sorted(labels) == sorted(ROWS)
  names = list(labels)
  for i, a in enumerate(names):
    assert not any(labels[a].overlaps(labels[b]) for b in names[i + 1:]), a
    assert not any(labels[a].overlaps(p) for p in points), a
    assert ax.get_window_extent().contains(labels[a].x0, labels[a].y0), a


def test_perplexity_axis_is_symmetric_log_and_labels_give_the_values(tmp_path):
  fig, ax = plot(rows(), str(tmp_path / "demo.png"), "title", "emulator")
  assert ax.get_xscale() == "symlog"
  lo, hi = ax.get_xlim()
  assert lo < 0 < 7.42 < 26.45 < 7387.07 < hi
  texts = sorted(t.get_text() for t in ax.texts)
  assert "quality (+7.4%, 4.31 ms)" in texts and "substitute_all (+7387%, 1.69 ms)" in texts
  # quality and speed: two decades apart on screen, not 0.3% of the axis as on a linear one
  x = lambda v: ax.transData.transform((v, 0))[0]
  assert x(26.45) - x(7.42) > 0.05 * (x(hi) - x(lo))
