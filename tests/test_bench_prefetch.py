"""benchmarks.prefetch (launch.bench_prefetch): its interleaved rounds, the order, the
median round, the per-round ratios."""

from absl import flags
from absl.testing import flagsaver
import pytest

from benchmarks import prefetch as B


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


def test_heldout_recall_per_source_hand_checked():
  """Per-document recall sums (summarize_run) and their per-source recall: two streams,
  stream 0 a stdlib document, stream 1 a HumanEval one, 2 decoded tokens each."""
  import numpy as np
  from moejax.research import emulator as E
  from moejax.research.study import metrics as M
  from moejax.research.study.streams import Streams
  t = 3
  st = Streams(tokens=np.zeros((2, t), np.int32), targets=np.zeros((2, t), np.int32),
               scored=np.ones((2, t), bool), real=np.ones((2, t), bool),
               doc=np.array([[0, 0, 0], [1, 1, 1]], np.int32),
               offset=np.tile(np.arange(t, dtype=np.int32), (2, 1)),
               pos=np.arange(t, dtype=np.int32), doc_source=["stdlib", "humaneval"],
               doc_name=["a.py", "HumanEval/0"])
  stats = np.zeros((2, t - 1, len(E.STATS)), np.float32)
  hits, calls = E.STATS.index("recall_hits"), E.STATS.index("predicted_calls")
  stats[0, :, calls] = 8.0                  # stdlib: 7 + 5 of 16 predicted experts right
  stats[0, :, hits] = [7.0, 5.0]
  stats[1, :, calls] = [8.0, 0.0]           # humaneval: 2 of 8, the second token predicted nothing
  stats[1, :, hits] = [2.0, 0.0]
  run = M.summarize_run({"nll": np.zeros((2, t)), "stats": stats}, st, 1)
  assert run["doc_recall_hits"].tolist() == [12.0, 2.0]
  assert run["doc_predicted"].tolist() == [16.0, 8.0]
  assert B._recall_of(run, st, "stdlib") == 12 / 16
  assert B._recall_of(run, st, "humaneval") == 2 / 8
  assert B._recall_of({"doc_nll": 0}, st, "stdlib") is None     # an older saved run
  res = {"modes": {}, "quality": {"modes": {"stream_hybrid_exact": {
      "recall_at_k": 14 / 24, "recall_at_k_stdlib": 0.75, "recall_at_k_humaneval": 0.25,
      "ppl_increase_pct": 0.0}}}}
  B.summarize(res)
  assert res["heldout_recall_at_k"] == {"recall_at_k": 14 / 24, "recall_at_k_stdlib": 0.75,
                                        "recall_at_k_humaneval": 0.25, "ppl_increase_pct": 0.0,
                                        "mode": "stream_hybrid_exact"}
