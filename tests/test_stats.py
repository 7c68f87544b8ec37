"""The statistics table: every part of the time per token sits directly under it.

The bug: under --prefetch=quasi the lines under "time per token" added up to 1.44 of
2.15 ms; "waiting for prefetches" was 12 lines further down."""

import types

import numpy as np
import pytest

from moejax.offload import stats

CFG = types.SimpleNamespace(moe_layers=(0, 1))


def token(wait, adm, pf, host, wall, prefetched=True):
  r = stats.TokenRecord(host_s=host, recall_hits=6.0 if prefetched else 0.0,
                        predicted_calls=8.0 if prefetched else 0.0, expert_calls=16.0,
                        hits=8.0)
  r.finish(wall, wait, adm, pf)
  return r


def indented_under_total(table: str) -> tuple[float, list[tuple[str, float]]]:
  lines = table.split("\n")
  i = next(k for k, l in enumerate(lines) if l.startswith("time per token"))
  parts = []
  for line in lines[i + 1:]:
    if not line.startswith("  "):
      break
    label, value = line.strip().rsplit("  ", 1)
    parts.append((label.strip(), float(value.strip().removesuffix(" ms"))))
  return float(lines[i].split()[3]), parts


@pytest.mark.parametrize("prefetched", [True, False])
def test_the_parts_of_the_time_per_token_add_up_to_it(prefetched):
  recs = [token(2e-4, 1e-4, 7.1e-4 if prefetched else 0.0, 3e-4, 2.15e-3, prefetched),
          token(1e-4, 0.0, 6.9e-4 if prefetched else 0.0, 2e-4, 2.15e-3, prefetched)]
  total, parts = indented_under_total(stats.format_stats(stats.summarize(recs, CFG), "x"))
  labels = [l for l, _ in parts]
  assert ("waiting for prefetches" in labels) == prefetched
  assert labels[-1] == "compute (rest)"
  assert total == 2.15 and sum(v for _, v in parts) == pytest.approx(total, abs=0.011)


def test_a_tally_summarises_as_the_records_would_past_its_head():
  rng = np.random.default_rng(0)
  n = stats.HEAD_TOKENS + 300
  recs = [token(*rng.uniform(0, 1e-4, 4), 1e-3 + rng.uniform(0, 1e-3)) for _ in range(n)]
  for r in recs:
    r.substituted_mass = float(rng.uniform())
  t = stats.tally(recs)
  for skip in (0, 16, stats.HEAD_TOKENS):
    got, want = stats.summary(t, CFG, skip), stats.summarize(recs[skip:], CFG)
    assert got.keys() == want.keys() and got["tokens"] == n - skip
    for k, v in want.items():
      assert got[k] == pytest.approx(v, rel=1e-12), k
    walls = [r.wall_s for r in recs[skip:]]        # and as the figures are defined
    assert got["tpot_ms"] == pytest.approx(1e3 * np.mean(walls), rel=1e-12)
    assert got["tpot_median_ms"] == 1e3 * np.median(walls)
    assert got["substituted_mass_per_token"] == pytest.approx(
        np.mean([r.substituted_mass for r in recs[skip:]]), rel=1e-12)
  with pytest.raises(ValueError, match=f"skip={stats.HEAD_TOKENS + 1}"):
    stats.summary(t, CFG, stats.HEAD_TOKENS + 1)
