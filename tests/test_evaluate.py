"""launch.evaluate end to end on the shipped demo model (small token caps)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "ckpts", "demo")


@pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "config.json")), reason="no demo model")
def test_evaluate_writes_the_locality_fields(tmp_path):
  out = tmp_path / "eval.json"
  r = subprocess.run([sys.executable, "-m", "launch.evaluate", f"--model_dir={DEMO}",
                      f"--out={out}", "--max_tokens=1024", "--domain_tokens=512",
                      "--locality_tokens=256", "--bigram=false", "--batch=4"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  for key in ("heldout_ppl", "humaneval_ppl", "lru_hit_rate_25", "lru_hit_rate_25_shuffled",
              "min_expert_load_share"):
    assert key in res
  assert set(res["domain_ppl"]) == {"python", "c", "english", "humaneval"}
  assert all(1.0 < p < 8192 for p in res["domain_ppl"].values())
  cur = res["locality"]["held-out stdlib"]["lru"]
  num_experts = json.load(open(os.path.join(DEMO, "config.json")))["num_experts"]
  assert [cur[f]["capacity"] for f in ("0.0625", "0.125", "0.25", "0.5")] == [
      round(f * num_experts) for f in (0.0625, 0.125, 0.25, 0.5)]
  rates = [cur[f]["ordered"] for f in ("0.0625", "0.125", "0.25", "0.5")]
  assert rates == sorted(rates)        # LRU is a stack algorithm: more slots, more hits
  assert res["lru_hit_rate_25"] == cur["0.25"]["ordered"]
  assert os.path.exists(tmp_path / "eval_locality.png")
  assert len(res["dead_experts_per_layer"]) == len(res["per_layer"])
