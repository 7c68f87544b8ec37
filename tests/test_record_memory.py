"""benchmarks.record_memory (`python -m launch.bench_memory --records`, issue 62): a short
run on the demo model through the on-device loop writes its samples, its growth, the
records kept (bounded), the steps stats() counts and whether the engine held glibc's mmap
threshold; `growth` on samples made by hand."""

import json
import platform

import pytest
from absl.testing import flagsaver

from benchmarks import memory  # noqa: F401  (defines --out and --model_dir)
from benchmarks import record_memory
from moejax.offload import stats as stats_lib


def test_growth_of_hand_made_samples():
  samples = [(0, 100), (10, 300), (20, 340), (30, 320), (40, 360)]
  g = record_memory.growth(samples, 1)
  assert (g["from_steps"], g["to_steps"], g["bytes"]) == (10, 40, 60)
  assert g["bytes_per_step"] == 2.0 and g["max_rise_bytes"] == 60.0
  assert g["fit_bytes_per_step"] == pytest.approx(1.6)     # least squares over the four


def test_a_short_native_run_keeps_a_bounded_number_of_records(tmp_path, monkeypatch):
  monkeypatch.setattr(stats_lib, "RECORDS_KEPT", 8)      # fewer than the run's 45 steps
  out = tmp_path / "records.json"
  with flagsaver.flagsaver():
    record_memory.FLAGS(["bench_memory", "--records", "--records_link=native",
                         "--records_tokens=40", "--records_generation=16", f"--out={out}"])
    assert record_memory.main() == 0
  res = json.loads(out.read_text())
  steps = [s for s, _ in res["samples"]]
  assert steps == [0, 15, 30, 45] and res["stats_tokens"] == 45     # whole generations
  assert res["records_kept"] == 8                         # never every record
  assert res["after_first_generation"]["from_steps"] == 15
  assert res["mmap_threshold_held"] == (platform.libc_ver()[0] == "glibc")
  assert [s for s, _ in res["malloc"]] == steps
