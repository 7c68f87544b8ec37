"""The statistics table: every part of the time per token sits directly under it.

The bug: under --prefetch=quasi the lines under "time per token" added up to 1.44 of
2.15 ms; "waiting for prefetches" was 12 lines further down."""

import types

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
