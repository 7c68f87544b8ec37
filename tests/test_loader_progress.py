"""The loader's progress bar: bytes of the checkpoint as they are read, on stderr, off when
stderr is not a terminal or when asked."""

import os
import sys

import numpy as np
import pytest

from moejax.io.loader import load_model
from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, save_file
from tests.test_loader import _save, model  # noqa: F401  (model: the checkpoint fixture)


# ------------------------------------------------------------------ progress bar
class _Bar:
  """Stands in for tqdm: records the total, the updates and whether they came before close."""
  made = []

  def __init__(self, total, file=None, **kw):
    self.total, self.n, self.updates, self.closed, self.file = total, 0, [], False, file
    _Bar.made.append(self)

  def update(self, k=1):
    assert not self.closed
    self.n += k
    self.updates.append(k)

  def close(self):
    self.closed = True


@pytest.fixture()
def bars(monkeypatch):
  import tqdm
  _Bar.made = []
  monkeypatch.setattr(tqdm, "tqdm", _Bar)
  return _Bar.made


def _checkpoint_bytes(d):
  f = SafetensorsFile(os.path.join(d, "model.safetensors"))
  return sum(f.header[k]["data_offsets"][1] - f.header[k]["data_offsets"][0] for k in f.keys())


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("mmap", [False, True])
def test_progress_bar_counts_every_checkpoint_byte_as_it_is_read(model, tmp_path, bars, layout,
                                                                   mmap):
  d = _save(model, tmp_path, layout)
  load_model(d, mmap=mmap, progress=True)
  bar = bars[0]
  assert bar.total == _checkpoint_bytes(d) and bar.n == bar.total and bar.closed
  assert len(bar.updates) > 3            # tensor by tensor, not once at the end
  assert bar.file is sys.stderr
  if mmap:   # the first mapped load repacks the experts, with a bar of its own
    assert len(bars) == 2 and bars[1].closed and bars[1].n == bars[1].total > 0
    load_model(d, mmap=mmap, progress=True)         # mapped from the cache: one bar
    assert len(bars) == 3 and bars[2].n == bars[2].total
  else:
    assert len(bars) == 1


def test_progress_off_when_asked_or_when_stderr_is_not_a_terminal(model, tmp_path, bars):
  d = _save(model, tmp_path)
  load_model(d, progress=False)
  load_model(d)                  # pytest's captured stderr is not a terminal
  assert not bars


def test_progress_bar_stops_short_on_a_corrupt_checkpoint(model, tmp_path, bars):
  d = _save(model, tmp_path)
  f = SafetensorsFile(os.path.join(d, "model.safetensors"))
  tensors = {k: np.array(f.get(k)) for k in f.keys()}
  del tensors[sorted(k for k in tensors if "experts" in k)[-1]]
  save_file(tensors, os.path.join(d, "model.safetensors"))
  with pytest.raises(CheckpointError):
    load_model(d, progress=True)
  (bar,) = bars
  assert bar.closed and bar.n < bar.total


def test_progress_bar_renders_on_stderr(model, tmp_path, capsys):
  load_model(_save(model, tmp_path), progress=True)
  err = capsys.readouterr().err
  assert "loading " in err and "B/s" in err
