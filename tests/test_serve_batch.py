"""Continuous batching (issue 47 item 2) with every expert resident: `moejax-serve
--policy=none --max_batch=4`, with the openai client.  Requests decoded together give the
text each gets alone (greedy, seeded sampling, log-probs), joining and leaving at token
boundaries; per-request policy fields are ignored and listed; the flags' usage errors."""

import concurrent.futures
import os
import subprocess
import sys

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.test_serve import DEMO, REPO, Server, _env  # noqa: E402

PROMPTS = ("def fibonacci(n):", "import os\n\n", "class Stack:\n    def", "for i in range(",
           "def read_config(path):", "# sort a list\n")
N = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = Server(tmp_path_factory.mktemp("batch"), args=["--policy=none", "--max_batch=4",
                                                     "--max_queue=16"])
  try:
    yield s
  finally:
    s.stop()


def complete(server, prompt, **kw):
  kw = dict(dict(max_tokens=N, temperature=0), **kw)
  return server.client().completions.create(model="demo", prompt=prompt, **kw)


def together(server, jobs):
  """The responses of `jobs` [(prompt, kwargs)], all sent at once (more than --max_batch:
  some join as others leave)."""
  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
    return list(ex.map(lambda j: complete(server, j[0], **j[1]), jobs))


def test_requests_decoded_together_equal_each_alone(server):
  jobs = [(p, {}) for p in PROMPTS] + [
      (PROMPTS[0], dict(temperature=0.9, seed=7)),           # seeded sampling
      (PROMPTS[1], dict(logprobs=2)),                        # log-probs
      (PROMPTS[2], dict(max_tokens=3)),                      # leaves early
      (PROMPTS[3], dict(stop=[")"]))]                        # a stop sequence
  alone = [complete(server, p, **kw) for p, kw in jobs]
  for _ in range(2):
    batch = together(server, jobs)
    for (p, kw), a, b in zip(jobs, alone, batch):
      assert b.choices[0].text == a.choices[0].text, (p, kw)
      assert b.choices[0].finish_reason == a.choices[0].finish_reason, (p, kw)
      assert b.usage.completion_tokens == a.usage.completion_tokens
  shared = lambda r: r.usage.model_extra["moejax"]["batch_mean"]
  assert max(shared(r) for r in alone) == 1.0          # one at a time
  assert max(shared(r) for r in batch) > 2.0           # decoded together
  lp_a, lp_b = alone[7].choices[0].logprobs, batch[7].choices[0].logprobs
  assert lp_a.tokens == lp_b.tokens
  np.testing.assert_allclose(lp_a.token_logprobs, lp_b.token_logprobs, atol=1e-5)
  assert batch[8].usage.completion_tokens == 3 and batch[8].choices[0].finish_reason == "length"
  assert batch[9].choices[0].finish_reason == "stop"


def test_the_resident_model_gives_the_samplers_tokens(server):
  """Batch 1 of the server is the resident model's greedy text (the offload engine's
  fetch_all equals it: tests/test_engine.py)."""
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.io.tokenizer import Tokenizer
  from moejax.model.sampler import Sampler, SamplingParams
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  s = Sampler(cfg, params, store.device_experts(jnp.float32), max_len=64)
  tok = Tokenizer(DEMO)
  ids = s.generate(tok.encode(PROMPTS[0]), SamplingParams(max_new_tokens=N))
  assert complete(server, PROMPTS[0]).choices[0].text == tok.decode(ids)


def test_policy_fields_are_ignored_and_listed(server):
  r = complete(server, PROMPTS[0], extra_body={"moejax": {"policy": "speed", "tau": 0.3}})
  usage = r.usage.model_extra["moejax"]
  assert usage["policy"] == "none (every expert resident)"
  assert usage["ignored"] == ["moejax.policy", "moejax.tau"]
  assert r.choices[0].text == complete(server, PROMPTS[0]).choices[0].text


def test_a_timeout_and_the_metrics(server):
  with pytest.raises(openai.APIStatusError) as e:
    complete(server, PROMPTS[1], max_tokens=40, extra_body={"moejax": {"timeout_s": 0.001}})
  assert e.value.status_code == 504
  text = httpx.get(server.url + "/metrics").text
  assert 'moejax_requests_total{outcome="timeout"}' in text


@pytest.mark.parametrize("args,match", [
    (["--policy=quality", "--max_batch=2", "--store=mmap", "--host_cache_gb=1"],
     "--max_batch=2 with --host_cache_gb"),
    (["--policy=none", "--max_batch=0"], "flag --max_batch=0: 0 is not a positive integer"),
    (["--policy=none", "--cache_fraction=0.5"], "--cache_fraction sets the offload engine"),
    (["--policy=none", "--max_batch=100000000", "--max_len=4096"],
     "the largest --max_batch that fits is"),
])
def test_usage_errors_before_loading(tmp_path, args, match):
  p = subprocess.run([sys.executable, "-m", "launch.serve", f"--model_dir={DEMO}", "--port=0",
                      *args], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2, p.stderr
  assert match in p.stderr and "Traceback" not in p.stderr, p.stderr
