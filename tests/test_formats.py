"""The weight format as a knob under a memory budget (moejax.research.formats): the table
of a tiny random model with the demo's tokenizer, in float and Q4_0, at a budget that holds
bf16 at 25% (Q4_0 at 88%) and at one that holds every format whole; the choice on rows as
the demo measures them (a random model's Q4_0 perplexity may fall either side of its
float's); moejax-generate's --weights=auto refusals."""

import dataclasses
import os

import jax.numpy as jnp
import pytest

from moejax.io.loader import init_random, load_model, save_hf
from moejax.io.tokenizer import Tokenizer
from moejax.model.config import ModelConfig
from moejax.research import autotune as A
from moejax.research import formats
from moejax.research import frontier as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = os.path.join(ROOT, "ckpts", "demo", "tokenizer.json")
CFG = ModelConfig(model_type="qwen3_moe", vocab_size=8192, hidden_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=32, num_experts=16, top_k=2,
                  moe_intermediate_size=32, intermediate_size=64, sparse_layers=(True, True),
                  qk_norm="head", rope_theta=10000.0, max_position_embeddings=128)
BF16 = 3 * 64 * 32 * 2                      # one expert in bf16
SMALL, LARGE = 4 * BF16 * 2, 16 * BF16 * 2  # bf16 at 4 of 16 a layer; every format whole
C = dataclasses.replace(F.AUTO, streams=2, max_tokens=192, window=64, chunk=64,
                        max_doc_tokens=96, bootstrap=50)
pytestmark = pytest.mark.skipif(not os.path.exists(TOK), reason="needs ckpts/demo's tokenizer")


def test_candidates_fill_the_budget_with_each_formats_bytes():
  small = {k.weights: k for k in formats.candidates(CFG, SMALL, ("float", "q8_0", "q4_0"))}
  assert small["float"].expert_bytes == BF16 and small["float"].slots == 4
  # Q8_0: 34 bytes a block of 32, Q4_0: 18 (gate_up 64 rows of 64 values, down 64 of 32)
  assert small["q8_0"].expert_bytes == 64 * 68 + 64 * 34 and small["q8_0"].slots == 7
  assert small["q4_0"].expert_bytes == 64 * 36 + 64 * 18 and small["q4_0"].slots == 14
  assert all(k.fraction == 1.0 for k in formats.candidates(CFG, LARGE, ("float", "q4_0")))
  with pytest.raises(A.AutoTuneError, match="q4_0 needs 6912 bytes"):
    formats.candidates(CFG, 4000, ("float", "q4_0"))


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("formats")
  params, exps = init_random(CFG, seed=2, scale=0.05)
  save_hf(CFG, params, exps, str(tmp / "tiny"), tokenizer_json=TOK)
  load = lambda w: load_model(str(tmp / "tiny"), dtype=jnp.bfloat16, weights=w)
  tok = Tokenizer(str(tmp / "tiny"))
  run = lambda b: formats.table(load, tok, b, A.Budget(ppl_pct=100.0), str(tmp / "out"),
                                formats=("float", "q4_0"), policies=("fetch_all",), c=C,
                                log=lambda s: None)
  return run(SMALL), run(LARGE)


def test_the_knob_picks_q4_0_when_bf16_does_not_fit(tables):
  small, large = ({r["weights"]: r for r in t["rows"]} for t in tables)
  assert small["float"]["cache_fraction"] == 0.25 and small["q4_0"]["cache_fraction"] == 0.875
  # fetch_all is exact: the float rows are the float model's perplexity; Q4_0's is its own
  assert small["float"]["ppl_increase_pct"] == large["float"]["ppl_increase_pct"] == 0.0
  assert small["q4_0"]["ppl_increase_pct"] != 0.0
  assert small["q4_0"]["ppl"] == pytest.approx(large["q4_0"]["ppl"], rel=1e-6)
  # bf16 at 25% waits for misses that Q4_0 at 88% mostly hits, and moves 3.6x the bytes
  assert small["float"]["fetches_per_token"] > small["q4_0"]["fetches_per_token"]
  assert small["float"]["projected_ms_per_token"] > large["float"]["projected_ms_per_token"]
  # the least perplexity increase within a time a token that bf16 meets only when whole
  tpot = 1.001 * max(large["float"]["projected_ms_per_token"],
                     small["q4_0"]["projected_ms_per_token"])
  assert small["float"]["projected_ms_per_token"] > tpot
  budget = A.Budget(tpot_ms=tpot, profile="rtx3090")
  assert formats.choose(tables[0]["rows"], budget).row["weights"] == "q4_0"
  fast = [r for r in tables[1]["rows"] if r["projected_ms_per_token"] <= tpot]
  want = min(fast, key=lambda r: r["ppl_increase_pct"])      # float unless Q4_0 measured < 0
  assert formats.choose(tables[1]["rows"], budget).row == want
  # within a perplexity budget the fastest: Q4_0 whole reads the fewest bytes
  assert tables[1]["choice"]["weights"] == "q4_0"
  assert "| **q4_0** |" in formats.format_table(tables[1])


def _row(weights, fraction, dppl, ms):
  return dict(weights=weights, cache_fraction=fraction, policy="fetch_all",
              ppl_increase_pct=dppl, projected_ms_per_token=ms)


def test_the_choice_is_bf16_when_the_budget_holds_it_at_the_requested_quality():
  """The choice on rows as the demo measures them (docs/policies.md): bf16 at 25% waits
  for misses (slow), Q4_0 at 88% costs +3.4% perplexity; when the budget holds bf16
  whole, bf16 is fast enough and exact."""
  small = [_row("float", 0.25, 0.0, 46.9), _row("q8_0", 0.47, -0.13, 14.0),
           _row("q4_0", 0.88, 3.41, 3.8)]
  large = [_row("float", 1.0, 0.0, 3.9), _row("q8_0", 1.0, -0.13, 2.2),
           _row("q4_0", 1.0, 3.41, 1.3)]
  ms10 = A.Budget(tpot_ms=10.0, profile="rtx3090")
  assert formats.choose(small, ms10).row["weights"] == "q4_0"
  assert formats.choose(large, ms10).row["weights"] == "q8_0"    # -0.13%: the least
  assert formats.choose(large[::2], ms10).row["weights"] == "float"
  assert formats.choose(small, A.Budget(ppl_pct=1.0)).row["weights"] == "q8_0"
  assert formats.choose(small, A.Budget(ppl_pct=5.0)).row["weights"] == "q4_0"
  with pytest.raises(A.AutoTuneError, match="--tpot_budget_ms=1: no policy"):
    formats.choose(small, A.Budget(tpot_ms=1.0, profile="rtx3090"))


@pytest.mark.parametrize("args", [["--policy=quality"], ["--policy=auto", "--ppl_budget=1"]])
def test_weights_auto_needs_policy_auto_and_cache_bytes(args):
  import subprocess
  import sys
  p = subprocess.run([sys.executable, "-m", "launch.generate", "--weights=auto", *args],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 2, p.stderr
  assert "--weights=auto weighs the formats under a memory budget" in p.stderr, p.stderr
