"""`moejax-generate --policy=auto --weights=auto --cache_bytes=N` on the demo model, end to
end through the console script's entry point (issue 61): the formats weighed, the choice
printed, the chosen format loaded, and text generated under the chosen policy.  The
weighing is cut to one calibration stream of 64 tokens (the command's own: 8 x 256) and
one policy (fetch_all; the command's: fetch_all and quality) so that the run takes under a
minute on two cores; everything else is the command's."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "ckpts", "demo")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "tokenizer.json")),
                                reason="needs the demo model in ckpts/demo")

RUN = """
import dataclasses, functools, sys
from moejax.research import formats, frontier
small = dataclasses.replace(frontier.AUTO, streams=1, max_tokens=64, window=64, chunk=64,
                            max_doc_tokens=64, bootstrap=20)
formats.table = functools.partial(formats.table, c=small, policies=("fetch_all",))
from moejax.cli import generate
sys.argv = ["moejax-generate"] + sys.argv[1:]
generate.entry()
"""


def test_weights_auto_chooses_a_format_and_generates(tmp_path):
  # a small budget: 300 kB of expert cache over the demo's 8 MoE layers holds 2 Q8_0
  # experts of 64 a layer and 5 Q4_0 ones; a float32 expert (49 kB) a layer does not fit
  env = dict(os.environ, MOEJAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", RUN, "--policy=auto", "--weights=auto",
                      "--cache_bytes=300000", "--ppl_budget=50", "--max_new_tokens=4",
                      "--prompt=def add(a, b):", "--nostream"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  err, lines = p.stderr, p.stderr.splitlines()
  assert "[formats] 300000 bytes of expert cache: q8_0 2/64 (3%), q4_0 5/64 (8%);" in err, err
  for w in ("q8_0", "q4_0"):
    assert f"[formats] {w} at " in err, err
  chosen = next(l for l in lines if l.startswith("[moejax] auto chose "))
  weights, policy = chosen.split()[3], chosen.split(" under ")[1].split(":")[0]
  assert weights in ("q8_0", "q4_0") and policy == "fetch_all", chosen
  assert f"| **{weights}** |" in err                          # the table marks it
  slots = {"q8_0": 2, "q4_0": 5}[weights]                     # the engine runs the choice
  engine = next(l for l in lines if l.startswith("[moejax] policy "))
  assert engine.startswith(f"[moejax] policy {policy} + lru; {slots}/64 experts per layer "
                           "resident (300000 bytes)"), engine
  assert p.stdout.startswith("def add(a, b):") and len(p.stdout) > len("def add(a, b):\n")
  assert "4 tokens generated" in err
