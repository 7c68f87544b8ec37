"""launch.bench_offload end to end on a small random-weight model: the JSON the issue asks for."""

import json
import subprocess
import sys


def test_bench_offload_writes_presets_bounds_and_links(tmp_path):
  out = tmp_path / "bench.json"
  cmd = [sys.executable, "-m", "launch.bench_offload", "--random_model", "--layers=2",
         "--prompt_len=4", "--warmup_tokens=2", "--decode_tokens=4", "--presets=baseline,quality",
         "--links=scaled,native", f"--out={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["link"].startswith("scaled") and set(r["links"]) == {"scaled", "native"}
  for spec, link in r["links"].items():
    for name in ("baseline", "quality"):
      p = link["presets"][name]
      for key in ("tpot_ms", "lower_bound_ms", "substituted_call_pct", "hit_rate"):
        assert p[key] >= 0, (spec, name, key)
      assert p["tpot_over_lower_bound"] == p["tpot_ms"] / p["lower_bound_ms"]
      # the bound: all-resident engine time + host time + sync fetches x one transfer
      s = p["stats"]
      expect = (r["engine_all_resident_tpot_ms"] + s["host_ms_per_token"]
                + link["expert_transfer_ms"] * s["fetches_per_token"])
      assert abs(p["lower_bound_ms"] - expect) < 1e-9
    assert link["presets"]["baseline"]["substituted_call_pct"] == 0
  assert r["presets"] == r["links"]["scaled"]["presets"]
  assert "tpot ms" in proc.stdout and "bound ms" in proc.stdout     # the terminal table


def test_overhead_segments_are_hand_checked_and_add_up():
  from moejax.offload.timeline import segments
  # start, a fetching MoE layer 0, a dense layer 1, a MoE layer 2 without fetch, head
  tr = [("start", -1, 0.0), ("attend", 0, 1.0), ("decided", 0, 1.2), ("fetch", 0, 1.3),
        ("arrived", 0, 2.3), ("moe", 0, 2.4), ("moe_done", 0, 2.6), ("dense", 1, 2.7),
        ("attend", 2, 3.0), ("decided", 2, 3.1), ("moe", 2, 3.3), ("moe_done", 2, 3.5),
        ("head", -1, 3.6), ("end", -1, 4.0)]
  s = segments([tr, tr], per_fetch_s=0.5, fetches_per_token=1.5)
  want = {"total": 4000, "embed": 1000, "head": 400, "F attend call": 200,
          "F host before": 100, "F fetch window": 1000, "F after window": 100,
          "F moe call": 200, "N attend call": 100, "N host before": 200, "N moe call": 200,
          "between layers": 500, "F   link time": 750, "F   queue + overrun": 250,
          "F layers per token": 1, "N layers per token": 1}
  assert set(s) == set(want)
  for k, v in want.items():
    assert abs(s[k] - v) < 1e-9, (k, s[k], v)


def test_bench_overhead_writes_segments_that_add_up(tmp_path):
  out = tmp_path / "overhead.json"
  cmd = [sys.executable, "-m", "launch.bench_overhead", "--random_model", "--layers=2",
         "--prompt_len=4", "--warmup_tokens=2", "--decode_tokens=4", "--presets=quality",
         "--links=scaled", "--context_reps=3", f"--out={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert set(r["segments_ms_per_token"]) == {"all resident", "quality"}
  for name, seg in r["segments_ms_per_token"].items():
    parts = sum(v for k, v in seg.items() if k not in (
        "total", "tpot_ms", "F   link time", "F   queue + overrun", "F layers per token",
        "N layers per token"))
    assert abs(parts - seg["total"]) < 1e-6 * seg["total"], (name, parts, seg["total"])
    assert abs(seg["total"] - seg["tpot_ms"]) < 1e-6 * seg["tpot_ms"]
    assert seg["F layers per token"] + seg["N layers per token"] == 2
  assert r["segments_ms_per_token"]["all resident"]["F layers per token"] == 0
  assert set(r["moe_call_us_after"]) >= {"nothing", "a helper thread woken"}
  assert "segment" in proc.stdout and "moe call" in proc.stdout
