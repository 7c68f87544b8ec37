"""bench_offload's report (benchmarks/offload.py): per link, each preset's row (its time per
token against the Sampler's and against the lower bound `LOWER_BOUND`), the scanned engines
over the unrolled ones, and the terminal table."""

from __future__ import annotations

import numpy as np

LOWER_BOUND = ("sampler_tpot_ms + fetches_per_token x expert_copy_ms + (emulated link) "
               "wait_ms + admission_wait_ms + prefetch_wait_ms per token; expert_copy_ms: "
               "min(expert_copy_call_ms, expert_copy_in_loop_ms), one expert's in-program copy "
               "from this run's store into a slot buffer")


def preset_rows(engines: dict, rounds: dict, sampler_rounds: list, link, copy_ms: float,
                skip: int) -> dict:
  """{preset: row} for one link: `engines` {preset: its engine}, `rounds` {preset: ms per
  token of each round}; each engine's stats skip its first `skip` tokens (the warm-up)."""
  sampler_ms = _median(sampler_rounds)
  rows = {}
  for preset, eng in engines.items():
    s = eng.stats(skip=skip)
    waits = (s["wait_ms_per_token"] + s["admission_wait_ms_per_token"]
             + s["prefetch_wait_ms_per_token"]) if link.emulated else 0.0
    lb = sampler_ms + copy_ms * s["fetches_per_token"] + waits
    tpot = _median(rounds[preset])
    rows[preset] = dict(
        policy=eng.policy.describe(), tpot_ms=tpot, lower_bound_ms=lb,
        tpot_over_sampler=tpot / sampler_ms, tpot_over_lower_bound=tpot / lb,
        tpot_ms_rounds=rounds[preset],
        tpot_over_sampler_rounds=[a / b for a, b in zip(rounds[preset], sampler_rounds)],
        emulated_wait_ms_per_token=waits, tpot_mean_ms=s["tpot_ms"],
        tpot_median_ms=s["tpot_median_ms"], substituted_call_pct=s["substituted_call_pct"],
        hit_rate=s["hit_rate"], misses_per_token=s.get("misses_per_token"), stats=s,
        budget=eng.budget.as_dict())
  base = rows.get("baseline", {}).get("tpot_ms")
  for r in rows.values():
    r["speedup_vs_baseline"] = base / r["tpot_ms"] if base else None
  return rows


def scan_over_unrolled(pairs: dict, rounds: dict, sampler_ms: float) -> dict:
  """{name: the scanned engine over the unrolled one}: `pairs` {name: (scanned runner,
  unrolled runner)}, `rounds` {runner: ms per token of each round}."""
  return {name: dict(ratio_of_medians=_median(rounds[a]) / _median(rounds[b]),
                     unrolled_tpot_ms=_median(rounds[b]),
                     rounds=[x / y for x, y in zip(rounds[a], rounds[b])],
                     unrolled_over_sampler=_median(rounds[b]) / sampler_ms)
          for name, (a, b) in pairs.items()}


def _median(xs) -> float:
  return float(np.median(xs))


def table(rows: dict, link_desc: str, sampler_ms: float) -> str:
  head = (f"link: {link_desc}; sampler {sampler_ms:.3f} ms/token\n"
          f"{'preset':<15}{'tpot ms':>9}{'x smp':>7}{'bound ms':>10}{'/bound':>8}{'x base':>8}"
          f"{'hit %':>7}{'subst %':>9}{'fetch/tok':>10}{'wait ms':>9}{'adm/tok':>8}")
  lines = [head]
  # tpot: median over rounds; bound: sampler + in-program copies + emulated waits
  for name, r in rows.items():
    s = r["stats"]
    sp = r["speedup_vs_baseline"]
    lines.append(f"{name:<15}{r['tpot_ms']:>9.3f}{r['tpot_over_sampler']:>7.2f}"
                 f"{r['lower_bound_ms']:>10.3f}{r['tpot_over_lower_bound']:>8.2f}{(sp or 0):>8.2f}"
                 f"{100 * r['hit_rate']:>7.1f}{r['substituted_call_pct']:>9.1f}"
                 f"{s['fetches_per_token']:>10.2f}{r['emulated_wait_ms_per_token']:>9.2f}"
                 f"{s['admissions_per_token']:>8.2f}")
  return "\n".join(lines)
