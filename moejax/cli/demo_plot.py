"""moejax-demo's figure: time per token against the perplexity increase, one point per
preset.

The increases span four decades on the demo model (baseline +0%, quality +7%,
speed +26%, substitute_all +7,400%), so the x axis is symmetric-log: linear
within +-1%, where the exact presets sit at 0, logarithmic beyond.  Each label goes
to the first of a few places around its point where it covers no other label or
point, with an arrow back when it had to move away.
"""

from __future__ import annotations

from moejax import extras

# offsets (points) tried in turn for a label: right, left, above, below, then further out
PLACES = ((8, 6), (8, -14), (-8, 6), (-8, -14), (0, 16), (0, -24), (24, 22), (24, -30),
          (-24, 22), (-24, -30), (40, 0), (-40, 0))


def _percent(x, _pos=None) -> str:
  return f"{x:+,.0f}%" if abs(x) >= 1 or x == 0 else f"{x:+.1f}%"


def place_labels(fig, ax, points: dict, texts: dict | None = None) -> dict:
  """{name: (x, y)} in data coordinates -> {name: the annotation} (text: texts[name], else
  the name); no two labels and no label and marker overlap where some place allows it
  (else the last place is kept)."""
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  taken = []                                   # display boxes of markers and placed labels
  for x, y in points.values():
    px, py = ax.transData.transform((x, y))
    taken.append((px - 5, py - 5, px + 5, py + 5))
  inside = ax.get_window_extent(renderer)
  labels = {}
  for name, (x, y) in points.items():
    for i, (dx, dy) in enumerate(PLACES):
      far = i >= 4
      ann = ax.annotate((texts or {}).get(name, name), (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=8,
                        ha="left" if dx > 0 else "right" if dx < 0 else "center",
                        arrowprops=dict(arrowstyle="-", color="0.5", lw=0.6) if far else None)
      b = ann.get_window_extent(renderer)
      box = (b.x0, b.y0, b.x1, b.y1)
      clear = not any(box[0] < t[2] and t[0] < box[2] and box[1] < t[3] and t[1] < box[3]
                      for t in taken)
      fits = (inside.x0 <= box[0] and box[2] <= inside.x1 and inside.y0 <= box[1]
              and box[3] <= inside.y1)
      if (clear and fits) or i == len(PLACES) - 1:
        taken.append(box)
        labels[name] = ann
        break
      ann.remove()
  return labels


def plot(rows: dict, path: str, title: str, ppl_source: str):
  """rows: {preset: {"ppl_increase_pct", "substituted_mass_per_token_layer", "tpot_ms"}}."""
  plt = extras.pyplot("demo.png")
  from matplotlib import ticker
  have_ppl = all(r["ppl_increase_pct"] is not None for r in rows.values())
  key = "ppl_increase_pct" if have_ppl else "substituted_mass_per_token_layer"
  points = {name: (float(r[key]), float(r["tpot_ms"])) for name, r in rows.items()}
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  for name, (x, y) in points.items():
    ax.scatter([x], [y], s=36, zorder=3)
  xs, ys = [p[0] for p in points.values()], [p[1] for p in points.values()]
  if have_ppl:
    ax.set_xscale("symlog", linthresh=1.0, linscale=0.6)
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(_percent))
    ax.set_xlabel("perplexity increase over the exact model (symmetric log scale)")
    ax.set_xlim(min(-0.5, min(xs) * 1.5), max(2.0, max(xs) * 4))
  else:
    ax.set_xlabel(f"substituted gate mass per token and MoE layer\n(perplexity: {ppl_source})")
    span = max(xs) - min(xs) or 1.0
    ax.set_xlim(min(xs) - 0.1 * span, max(xs) + 0.35 * span)
  span = max(ys) - min(ys) or 1.0
  ax.set_ylim(max(0.0, min(ys) - 0.2 * span), max(ys) + 0.2 * span)
  ax.set_ylabel("time per token (ms)")
  ax.set_title(title, fontsize=8)
  ax.grid(alpha=0.3, which="major")
  fig.tight_layout()
  fmt = ((lambda x: f"{x:+.1f}%" if abs(x) < 100 else f"{x:+.0f}%") if have_ppl else
         (lambda x: f"mass {x:.3f}"))
  place_labels(fig, ax, points, {n: f"{n} ({fmt(x)}, {y:.2f} ms)" for n, (x, y) in points.items()})
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return fig, ax
