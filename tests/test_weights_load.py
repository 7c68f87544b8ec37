"""--weights wherever a model is loaded: `moejax.load(..., weights=)` and the server's
--weights, on the demo model in Q8_0 (the repack is made once into the cache folder)."""

import json
import os
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.model.sampler import Sampler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")
PROMPT = "def fibonacci(n):\n"
pytestmark = pytest.mark.skipif(not os.path.isdir(DEMO), reason="the demo model is not in "
                                "ckpts/demo")


@pytest.fixture(scope="module")
def models():
  return moejax.load(DEMO), moejax.load(DEMO, weights="q8_0")


def _logits(model, ids):
  s = Sampler(model.cfg, model.params, model.store.device_experts(model.dtype), max_len=64)
  return np.asarray(s.prefill(np.asarray([ids]))[0], np.float32)


def test_the_api_loads_and_generates_in_a_block_format(models):
  flt, q8 = models
  q = q8.params["layers_0"]["self_attn"]["q_proj"]["weight"]
  assert q.qtype == "q8_0"
  assert sorted(q8.store.stacked(q8.cfg.moe_layers[0])) == ["down@q8_0", "gate_up@q8_0"]
  assert q8.store.expert_nbytes() < 0.3 * flt.store.expert_nbytes()   # 34/128 of f32's
  ids = flt.tokenizer.encode(PROMPT)
  a, b = _logits(flt, ids), _logits(q8, ids)
  # 8-bit blocks (and, on the CPU kernels, activations rounded to 8 bits a block): close
  assert np.abs(a - b).max() < 0.1 * np.abs(a).max() and a.argmax() == b.argmax()
  assert not np.array_equal(a, b)                         # the blocks are what ran
  # greedy: the same first tokens (the demo's Q8_0 text parts from f32's at the 5th)
  assert moejax.generate(q8, PROMPT, max_new_tokens=3) == moejax.generate(flt, PROMPT,
                                                                          max_new_tokens=3)


def test_the_server_serves_a_block_format(models):
  from benchmarks.serve_client import start_server
  q8 = models[1]
  proc, url = start_server(DEMO, "16", "none", max_len=48, extra=["--weights=q8_0"])
  try:
    body = json.dumps(dict(model="demo", prompt=PROMPT, max_tokens=6,
                           temperature=0)).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
      text = json.loads(r.read())["choices"][0]["text"]
  finally:
    proc.terminate()
    proc.wait(60)
  assert text == moejax.generate(q8, PROMPT, max_new_tokens=6)
