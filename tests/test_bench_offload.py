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
