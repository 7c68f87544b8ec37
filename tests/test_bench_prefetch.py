"""launch.bench_prefetch's interleaved rounds: the order, the median round, per-round ratios."""

from absl import flags
from absl.testing import flagsaver
import pytest

from launch import bench_prefetch as B


@pytest.fixture(autouse=True)
def _parsed_flags():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["bench_prefetch"])


def test_rounds_rotate_the_order_and_keep_the_median_round(monkeypatch):
  calls = []
  # on_demand's tpot per round 30, 10, 20 (median 20); quasi's 5, 6, 7 (median 6)
  times = {"on_demand": iter([30.0, 10.0, 20.0]), "stream_quasi_spec": iter([5.0, 6.0, 7.0])}

  def fake_time_mode(cfg, params, store, link, mode, preds, tokens):
    name = next(n for n, m in B.MODES.items() if m is mode)
    calls.append(name)
    t = next(times[name])
    return {"tpot_ms": t, "stall_ms_per_token": t / 10}

  monkeypatch.setattr(B, "time_mode", fake_time_mode)
  with flagsaver.flagsaver(rounds=3):
    out = B.time_rounds(None, None, None, None, ["on_demand", "stream_quasi_spec"], {}, None)
  assert calls == ["on_demand", "stream_quasi_spec", "stream_quasi_spec", "on_demand",
                   "on_demand", "stream_quasi_spec"]
  assert out["on_demand"]["tpot_ms"] == 20.0 and out["on_demand"]["stall_ms_per_token"] == 2.0
  assert out["on_demand"]["tpot_ms_rounds"] == [30.0, 10.0, 20.0]
  assert out["stream_quasi_spec"]["tpot_ms"] == 6.0
  assert out["stream_quasi_spec"]["prefetch"] == "quasi"      # the mode's settings kept
  # per round, against on-demand of the same round: 1 - 5/30, 1 - 6/10, 1 - 7/20
  red = B._per_round(out, "stream_quasi_spec")
  assert red == pytest.approx([100 * (1 - 5 / 30), 40.0, 65.0])


def test_summary_takes_the_fastest_mode_within_one_percent():
  m = {"on_demand": {"tpot_ms": 20.0, "tpot_ms_rounds": [20.0], "ppl_increase_pct": 0.0},
       "stream_reuse_spec": {"tpot_ms": 10.0, "tpot_ms_rounds": [10.0], "prefetch": "reuse",
                             "speculative": "predicted_weights", "ppl_increase_pct": 6.0,
                             "recall_at_k_per_layer": {}},
       "stream_hybrid_spec_true_router": {"tpot_ms": 15.0, "tpot_ms_rounds": [15.0],
                                          "prefetch": "hybrid", "speculative": "true_router",
                                          "ppl_increase_pct": 0.5,
                                          "recall_at_k_per_layer": {}}}
  res = {"modes": m}
  B.summarize(res)
  assert res["best_speculative_mode"] == "stream_reuse_spec"
  assert res["tpot_reduction_pct"] == pytest.approx(50.0)
  assert res["best_mode_within_1pct_ppl"] == "stream_hybrid_spec_true_router"
  assert res["tpot_reduction_within_1pct_ppl_pct"] == pytest.approx(25.0)
  assert res["tpot_reduction_within_1pct_ppl_pct_rounds"] == pytest.approx([25.0])
