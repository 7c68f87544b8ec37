"""launch.frontier and moejax.research.autotune: the frontier's JSON, the auto choice, the
pure selection functions."""

import json
import os
import subprocess
import sys

import chex
import numpy as np
import pytest

from moejax.research import autotune as A
from moejax.research import quality_fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 5.0
POINT_KEYS = ("policy", "ppl_increase_pct", "waited_bytes_ratio", "projected_speedup_rtx3090",
              "heldout")


def _frontier(args, out):
  return subprocess.run([sys.executable, "-m", "launch.frontier", f"--out={out}", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  """A small run on the demo model: 4 streams x 33 tokens per split, 5 swept thresholds."""
  out = tmp_path_factory.mktemp("frontier")
  p = _frontier(["--streams=4", "--max_tokens=132", "--window=32", "--max_doc_tokens=64",
                 "--taus=0.1,0.3", "--presets=", f"--ppl_budgets={BUDGET:g}",
                 "--sweep_taus=0.03,0.05,0.1,0.2,0.3", "--sweep_lams=", "--combos=lru:none"],
                out)
  assert p.returncode == 0, p.stderr[-3000:]
  with open(out / "frontier.json") as f:
    res = json.load(f)
  return res, out, p.stdout


def test_json_schema_and_png(result):
  res, out, stdout = result
  assert os.path.getsize(out / "frontier.png") > 10_000
  fa = res["fetch_all"]
  assert fa["ppl"] > 1 and fa["waited_bf16_bytes_per_token"] > 0
  assert fa["heldout"]["ppl"] > 1 and fa["heldout"]["waited_bf16_bytes_per_token"] > 0
  assert len(res["points"]) >= 5
  for q in res["points"]:
    for k in POINT_KEYS:
      assert k in q, k
    chex.assert_type([q["ppl_increase_pct"], q["waited_bytes_ratio"],
                      q["projected_speedup_rtx3090"]], float)
    assert isinstance(q["heldout"], bool) and q["waited_bytes_ratio"] >= 0
    assert q["projected_speedup_rtx3090"] > 0
  assert {q["heldout"] for q in res["points"]} == {False, True}
  assert "fetch_all" in stdout and "pareto" in stdout     # the terminal table


def test_fetch_all_point_is_zero_and_ratio_one(result):
  res, _, _ = result
  fa = [q for q in res["points"] if q["role"] == "fetch_all"]
  assert {q["heldout"] for q in fa} == {False, True}
  for q in fa:
    assert q["ppl_increase_pct"] == 0.0
    assert q["waited_bytes_ratio"] == pytest.approx(1.0)
    assert q["projected_speedup_rtx3090"] == pytest.approx(1.0)
  # substituting points wait for fewer bytes and are projected faster
  for q in res["points"]:
    if q["role"] == "threshold":
      assert q["waited_bytes_ratio"] < 1 and q["projected_speedup_rtx3090"] > 1


def test_auto_choice_meets_its_budget_on_the_calibration_streams(result):
  res, _, _ = result
  (a,) = res["auto"]
  assert a["budget"]["ppl_pct"] == BUDGET
  assert a["calibration_pct"] <= BUDGET
  cal = [q for q in res["points"] if q["policy"] == a["policy"] and not q["heldout"]]
  assert len(cal) == 1 and cal[0]["ppl_increase_pct"] == pytest.approx(a["calibration_pct"])
  assert any(q["policy"] == a["policy"] and q["heldout"] for q in res["points"])
  # the fastest measured calibration point within the budget (fetch_all excepted)
  ok = [q for q in res["points"] if not q["heldout"] and q["role"] != "fetch_all"
        and q["ppl_increase_pct"] <= BUDGET]
  assert cal[0]["projected_ms_per_token_rtx3090"] == min(q["projected_ms_per_token_rtx3090"]
                                                         for q in ok)


def test_frontier_is_pareto(result):
  res, _, _ = result
  cal = [q for q in res["points"] if not q["heldout"]]
  xy = np.asarray([(q["projected_ms_per_token_rtx3090"], q["ppl_increase_pct"]) for q in cal])
  dominated = lambda i: any(np.all(xy[j] <= xy[i]) and np.any(xy[j] < xy[i])
                            for j in range(len(xy)) if j != i)
  front = [q["pareto"] for q in cal]
  assert any(front)
  for i, f in enumerate(front):
    assert f == (not dominated(i)), cal[i]["policy"]
  assert sorted(res["frontier"]) == sorted(q["policy"] for q in cal if q["pareto"])


def test_bad_budget_is_one_line_naming_the_flag():
  p = _frontier(["--ppl_budgets=0"], "/tmp/unused_frontier")
  assert p.returncode == 2
  assert "--ppl_budgets" in p.stderr and len(p.stderr.strip().splitlines()) <= 2
  p = _frontier(["--tpot_budget_ms=5"], "/tmp/unused_frontier")
  assert p.returncode == 2 and "--profile" in p.stderr
  p = _frontier(["--sweep_low_bits=3"], "/tmp/unused_frontier")
  assert p.returncode == 2 and "--sweep_low_bits" in p.stderr


def test_grid_sweeps_the_cost_rule_with_each_low_precision():
  g = A.grid(taus=(0.1,), combos=(("lru", None),), lams=(0.3, 1.0), extra=(), low_bits=(8, 4))
  cost = sorted((p.decision.lam, p.decision.low_bits) for p in g if p.miss == "cost")
  assert cost == [(0.3, 4), (0.3, 8), (1.0, 4), (1.0, 8)]
  assert all(p.decision.low_bits == 8 for p in A.grid(lams=(0.3,)) if p.miss == "cost")


def test_isotonic_fit_is_monotone_through_the_origin():
  fit = quality_fit.fit_quality([0.01, 0.02, 0.03, 0.0], [0.6, 0.4, 2.0, 0.3])
  assert fit.mass[0] == 0 and fit.dppl[0] == pytest.approx(0, abs=1e-3)
  assert np.all(np.diff(fit.dppl) >= 0)
  np.testing.assert_allclose(fit.dppl[1:3], [0.5, 0.5])        # the violators pooled
  pred = fit.predict([0.0, 0.005, 0.03, 0.04])
  assert pred[1] == pytest.approx(0.25, abs=1e-3)                # interpolated
  assert pred[3] == pytest.approx(2.0 + 1.5, abs=1e-6)           # the last slope extended


def test_pareto_and_choose():
  ms = np.array([10.0, 5.0, 7.0, 5.0, 3.0])
  dppl = np.array([0.0, 2.0, 0.5, 3.0, 9.0])
  np.testing.assert_array_equal(A.pareto(ms, dppl), [True, True, True, False, True])
  cand = np.array([False, True, True, True, True])
  assert A.choose(dppl, ms, A.Budget(ppl_pct=1.0), cand) == 2
  assert A.choose(dppl, ms, A.Budget(ppl_pct=2.0), cand) == 1
  assert A.choose(dppl, ms, A.Budget(tpot_ms=6.0, profile="rtx3090"), cand) == 1
  labels = ["fa", "a", "b", "c", "d"]
  with pytest.raises(A.AutoTuneError, match=r"--ppl_budget=0.1: .* b, is at \+0.5%.*"
                     r"--ppl_budget=0.5"):
    A.choose(dppl, ms, A.Budget(ppl_pct=0.1), cand, labels)
  with pytest.raises(A.AutoTuneError, match=r"--tpot_budget_ms=1: .*--tpot_budget_ms=3"):
    A.choose(dppl, ms, A.Budget(tpot_ms=1.0, profile="rtx3090"), cand, labels)
  for bad, flag in ((dict(ppl_pct=-1.0), "--ppl_budget"), (dict(tpot_ms=3.0), "--profile"),
                    ({}, "--ppl_budget")):
    with pytest.raises(A.AutoTuneError, match=flag):
      A.Budget(**bad)


def test_tune_measures_until_the_choice_meets_the_budget():
  """The fit over-promises one point; tune measures it, refits and settles on a point whose
  measured increase meets the budget."""
  pol = lambda t: A.policy_lib.make_policy("threshold", tau=t)
  pts = [A.Point(A.policy_lib.make_policy("fetch_all"), 0.0, 10, 10, {"rtx3090": 10.0}, 1)]
  pts += [A.Point(pol(t), m, 1, 1, {"rtx3090": ms}, 1)
          for t, m, ms in ((0.05, 0.01, 8.0), (0.1, 0.02, 6.0), (0.2, 0.03, 4.0))]
  truth = {0.05: 0.4, 0.1: 1.6, 0.2: 1.2}
  seen = []
  measure = lambda p: seen.append(p.tau) or truth[p.tau]
  ch = A.tune(pts, {0: 0.0, 3: 1.2}, measure, A.Budget(ppl_pct=1.0))
  assert seen == [0.1, 0.05]            # 0.1 predicted +0.8% (mass 0.02), measured +1.6%
  assert ch.index == 1 and ch.measured_pct == 0.4


def test_refine_sweeps_the_knob_between_its_neighbours():
  grid = A.grid(taus=(0.05, 0.1, 0.2), combos=(("lru", None),), lams=(), extra=())
  i = [A.label(p) for p in grid].index("threshold(0.1) + lru")
  taus = sorted(p.tau for p in A.refine(grid, i, n=2))
  np.testing.assert_allclose(taus, [0.063, 0.0794, 0.126, 0.159])
  assert all(p.miss == "threshold" and p.eviction == "lru" for p in A.refine(grid, i, n=2))
  assert A.refine(grid, 0) == []                      # fetch_all has no knob


@pytest.mark.parametrize("args, says", [
    (["--policy=auto"], "--ppl_budget"),
    (["--policy=auto", "--tpot_budget_ms=20"], "--profile"),
    (["--policy=auto", "--tpot_budget_ms=20", "--profile=nope"], "--profile: unknown"),
    (["--policy=auto", "--tpot_budget_ms=20", "--profile=rtx3090x2"],
     "--expert_devices=1: use --profile=rtx3090"),
    (["--policy=auto", "--tpot_budget_ms=20", "--profile=rtx3090", "--expert_devices=2"],
     "use --profile=rtx3090x2"),
    (["--policy=auto", "--ppl_budget=1", "--tau=0.1"], "--tau is chosen by --policy=auto"),
    (["--ppl_budget=1"], "--ppl_budget applies only with --policy")])
def test_generate_auto_flags_are_one_line_usage_errors(args, says):
  p = subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and says in p.stderr, p.stderr
