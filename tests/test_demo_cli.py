"""launch.demo end to end on the demo model, reduced (3 tokens): the table's invariants."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["baseline", "quality", "speed", "host", "substitute_all"]


def emulator_available() -> bool:
  try:
    import moejax.research.emulator  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    return True
  except ImportError:
    return False


def test_demo_table_json_and_png(tmp_path):
  cmd = [sys.executable, "-m", "launch.demo", "--max_new_tokens=3", "--eval_tokens=33",
         "--eval_window=16", "--link=scaled", f"--out_dir={tmp_path}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  json_path, png_path = tmp_path / "demo.json", tmp_path / "demo.png"
  assert f"wrote {json_path}" in out and f"wrote {png_path}" in out
  assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  r = json.loads(json_path.read_text())
  assert list(r["presets"]) == PRESETS                        # every preset, in order
  assert len(r["timed_tokens"]) == 3
  assert r["link"].startswith("scaled") and "link    scaled" in out
  num_experts = json.load(open(os.path.join(REPO, "ckpts", "demo", "config.json")))["num_experts"]
  assert r["budget"]["slots_per_layer"] == num_experts // 4   # 25% of the experts
  for name, p in r["presets"].items():
    s = p["stats"]
    assert f"\n{name} " in out                                # a table row
    assert s["tokens"] == 2                                   # 3 tokens: 2 decode steps
    # timed on the exact model's tokens: every preset's timing pass fed the same ones
    assert p["stats"]["tokens"] == len(r["timed_tokens"]) - 1
    assert abs(s["hits_per_token"] + s["misses_per_token"] - s["expert_calls_per_token"]) < 1e-9
    assert s["expert_calls_per_token"] == 8 * 8                # top-8 x 8 MoE layers
    assert 0 <= p["hit_rate"] <= 1
    assert p["speedup_vs_baseline"] == r["presets"]["baseline"]["tpot_ms"] / p["tpot_ms"]
  base = r["presets"]["baseline"]
  assert base["substituted_call_pct"] == 0 and base["substituted_mass_per_token_layer"] == 0
  assert base["stats"]["host_calls_per_token"] == 0
  assert r["presets"]["host"]["substituted_call_pct"] == 0
  assert r["presets"]["substitute_all"]["fetches_per_token"] == 0
  assert "quality preset" in out and "exact model (baseline)" in out
  if emulator_available():
    assert base["ppl_increase_pct"] == 0 and base["ppl"] > 1
    assert r["perplexity"]["tokens"] == 32
  else:
    assert base["ppl_increase_pct"] is None
    assert "n/a (emulator not available)" in out


def test_demo_usage_errors():
  for args, needle in ((["--presets=quality,baseline"], "must start with baseline"),
                       (["--max_new_tokens=1"], "--max_new_tokens must be >= 2"),
                       (["--presets=baseline,quality,quality"], "names a preset twice"),
                       (["--eval_tokens=-1"], "flag --eval_tokens=-1: -1 is not a non-negative integer"),
                       (["--block=0"], "flag --block=0: 0 is not a positive integer"),
                       (["--model_dir=/nonexistent"], "has no config.json")):
    proc = subprocess.run([sys.executable, "-m", "launch.demo", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
