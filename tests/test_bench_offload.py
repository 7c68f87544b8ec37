"""launch.bench_offload end to end on a small random-weight model: the JSON the issue asks for."""

import json
import subprocess
import sys


def test_bench_offload_writes_presets_sampler_bounds_and_links(tmp_path):
  out = tmp_path / "bench.json"
  cmd = [sys.executable, "-m", "launch.bench_offload", "--random_model", "--layers=2",
         "--prompt_len=4", "--warmup_tokens=2", "--decode_tokens=4", "--rounds=2",
         "--presets=baseline,quality", "--links=scaled,native", "--store=pinned_host",
         f"--out={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["link"].startswith("scaled") and set(r["links"]) == {"scaled", "native"}
  assert r["store"] == "pinned_host" and r["rounds"] == 2
  smp = r["sampler_tpot_ms"]
  assert smp > 0 and len(r["sampler_tpot_ms_rounds"]) == 2
  assert r["expert_copy_ms"] > 0 and r["engine_all_resident_tpot_ms"] > 0
  for spec, link in r["links"].items():
    for name in ("baseline", "quality"):
      p = link["presets"][name]
      for key in ("tpot_ms", "lower_bound_ms", "substituted_call_pct", "hit_rate"):
        assert p[key] >= 0, (spec, name, key)
      assert p["tpot_over_sampler"] == p["tpot_ms"] / smp
      assert p["tpot_over_lower_bound"] == p["tpot_ms"] / p["lower_bound_ms"]
      assert p["stats"]["tokens"] == 4 and len(p["tpot_ms_rounds"]) == 2
      # the bound: the Sampler's time + waited fetches x one in-program copy + emulated waits
      s = p["stats"]
      waits = (s["wait_ms_per_token"] + s["admission_wait_ms_per_token"]
               + s["prefetch_wait_ms_per_token"])
      assert p["emulated_wait_ms_per_token"] == (waits if spec == "scaled" else 0.0)
      expect = smp + r["expert_copy_ms"] * s["fetches_per_token"] + p["emulated_wait_ms_per_token"]
      assert abs(p["lower_bound_ms"] - expect) < 1e-9
    assert link["presets"]["baseline"]["substituted_call_pct"] == 0
    assert link["presets"]["baseline"]["stats"]["fetches_per_token"] > 0
    if spec == "scaled":          # baseline's fetches wait on the emulated link
      assert link["presets"]["baseline"]["emulated_wait_ms_per_token"] > 0
  assert r["presets"] == r["links"]["scaled"]["presets"]
  assert "tpot ms" in proc.stdout and "bound ms" in proc.stdout     # the terminal table
  assert "sampler" in proc.stdout and "x smp" in proc.stdout
