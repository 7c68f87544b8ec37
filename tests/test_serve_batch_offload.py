"""Continuous batching under an offload policy (issue 47 item 2): `moejax-serve
--policy=baseline --max_batch=4`, with the openai client.  fetch_all decoded together gives
each request's text alone (and the resident model's); the rows report their own offload
statistics; a request under another policy waits for the running rows, then the batch
switches to it; a --max_batch beyond the memory plan is a usage error."""

import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.test_serve import DEMO, REPO, Server, _env  # noqa: E402
from tests.test_serve_batch import PROMPTS, N, complete, together  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = Server(tmp_path_factory.mktemp("batch_offload"),
             args=["--policy=baseline", "--max_batch=4", "--max_queue=16", "--link=native",
                   "--max_policies=3"])
  try:
    yield s
  finally:
    s.stop()


def test_fetch_all_rows_decoded_together_equal_each_alone(server):
  jobs = [(p, {}) for p in PROMPTS] + [(PROMPTS[0], dict(temperature=0.9, seed=7)),
                                       (PROMPTS[2], dict(max_tokens=3))]
  alone = [complete(server, p, **kw) for p, kw in jobs]
  batch = together(server, jobs)
  for (p, kw), a, b in zip(jobs, alone, batch):
    assert b.choices[0].text == a.choices[0].text, (p, kw)
    assert b.usage.completion_tokens == a.usage.completion_tokens
  moe = [r.usage.model_extra["moejax"] for r in batch]
  assert max(m["batch_mean"] for m in moe) > 2.0          # decoded together
  assert all(m["policy"].startswith("baseline") for m in moe)
  assert all(m["decode_steps"] == r.usage.completion_tokens - 1 for m, r in zip(moe, batch))
  assert all(m["hit_rate"] is not None and 0 <= m["hit_rate"] <= 1 for m in moe
             if m["decode_steps"])
  assert sum(m["fetches_per_token"] for m in moe) > 0     # the rows' own fetches
  assert all(m["prompt_fetches"] is not None for m in moe)


def test_fetch_all_batch_gives_the_resident_models_text(server):
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.io.tokenizer import Tokenizer
  from moejax.model.sampler import Sampler, SamplingParams
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  s = Sampler(cfg, params, store.device_experts(jnp.float32), max_len=64)
  tok = Tokenizer(DEMO)
  batch = together(server, [(p, {}) for p in PROMPTS[:4]])
  for p, r in zip(PROMPTS[:4], batch):
    ids = s.generate(tok.encode(p), SamplingParams(max_new_tokens=N))
    assert r.choices[0].text == tok.decode(ids)


def test_a_request_under_another_policy_waits_then_runs(server):
  jobs = [(PROMPTS[0], {}), (PROMPTS[1], dict(extra_body={"moejax": {"policy": "speed"}})),
          (PROMPTS[2], {})]
  out = together(server, jobs)
  pol = [r.usage.model_extra["moejax"]["policy"] for r in out]
  assert pol[1].startswith("speed") and pol[0].startswith("baseline")
  assert all(r.usage.completion_tokens == N for r in out)
  # back to the server's policy, compiled already: nothing to compile
  again = complete(server, PROMPTS[1], extra_body={"moejax": {"policy": "speed"}})
  assert again.usage.model_extra["moejax"]["compile_ms"] == 0.0


def test_max_batch_beyond_the_memory_plan_is_a_usage_error(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "launch.serve", f"--model_dir={DEMO}",
                         "--policy=quality", "--max_batch=100000000", "--port=0"],
                        cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2, proc.stderr
  line = next(x for x in proc.stderr.splitlines() if "--max_batch=100000000" in x)
  assert "offloaded model" in line and "largest --max_batch that fits is" in line
