"""/metrics is exact and counts every answer.

The bugs: moejax_expert_calls_total{action="other"} showed 1.13687e-13 (float shares
multiplied back and subtracted), counts printed as %.6g (1234567 -> 1.23457e+06), and
400 answers were counted under no outcome."""

import os
import re

import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from moejax.offload.stats import TokenRecord  # noqa: E402
from moejax.serve import metrics as metrics_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")


def sample(text, name):
  m = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
  assert m, (name, text)
  return m.group(1)


def test_expert_calls_are_exact_integers():
  m = metrics_lib.Metrics()
  # 3 tokens x 8 layers x top-8: shares like 61/192 do not multiply back exactly
  records = [TokenRecord(expert_calls=64.0, hits=61.0 - i, substituted=2.0, fetches=1.0 + i,
                         wait_s=0.001) for i in range(3)]
  m.finished(1_234_567, 0.01, 100.0, records)
  text = m.render()
  assert sample(text, 'moejax_expert_calls_total{action="other"}') == "0"
  assert sample(text, 'moejax_expert_calls_total{action="hit"}') == "180"
  assert sample(text, 'moejax_expert_calls_total{action="fetched"}') == "6"
  assert sample(text, "moejax_generated_tokens_total") == "1234567"
  m.finished(1, None, None, [TokenRecord(expert_calls=8.0, hits=5.0, dropped=2.0,
                                         host_calls=1.0)])
  calls = {k: int(sample(m.render(), f'moejax_expert_calls_total{{action="{k}"}}'))
           for k in metrics_lib.CALLS}
  assert calls == {"hit": 185, "substituted": 6, "fetched": 6, "other": 3}
  assert sum(calls.values()) == 3 * 64 + 8


def test_a_batch_steps_wait_counts_once():
  """Rows of one batch step each carry the step's wait (as their request saw it); the
  server's total counts the step once."""
  m = metrics_lib.Metrics()
  step = [TokenRecord(expert_calls=8.0, hits=8.0, wait_s=0.25, rows=4) for _ in range(4)]
  m.finished(4, 0.01, 100.0, step[:2])       # two requests of the batch
  m.finished(4, 0.01, 100.0, step[2:])
  assert float(sample(m.render(), "moejax_fetch_wait_seconds_total")) == 0.25


def test_every_answer_is_counted():
  from moejax.cache.policy import make_policy
  from moejax.io.tokenizer import Tokenizer
  from moejax.serve import app as app_lib, protocol
  from moejax.serve.worker import Worker
  m = metrics_lib.Metrics()
  worker = Worker(lambda: None, m, max_queue=1)           # not started: nothing dequeues
  limits = protocol.Limits("demo", 64, 10.0, make_policy("quality"), (0,))
  client = TestClient(app_lib.create_app(worker, limits, m, Tokenizer(DEMO), None))
  body = {"model": "demo", "prompt": "x", "max_tokens": 2}
  assert client.post("/v1/completions", json=body).status_code == 503      # loading
  worker.ready.set()
  assert client.post("/v1/completions", json={**body, "model": "gpt-4"}).status_code == 400
  assert client.post("/v1/completions", content=b"{").status_code == 400
  assert client.post("/v1/chat/completions", json=body).status_code == 400  # no template
  assert client.get("/nowhere").status_code == 404
  assert client.get("/health").status_code == 200
  worker.submit(protocol_job(body))                        # fills the queue of 1
  assert client.post("/v1/completions", json=body).status_code == 429
  text = m.render()
  outcomes = {k: sample(text, f'moejax_requests_total{{outcome="{k}"}}')
              for k in ("unavailable", "invalid", "rejected")}
  assert outcomes == {"unavailable": "1", "invalid": "3", "rejected": "1"}, text
  codes = {k: sample(text, f'moejax_http_responses_total{{code="{k}"}}')
           for k in (503, 400, 404, 200, 429)}
  assert codes == {503: "1", 400: "3", 404: "1", 200: "1", 429: "1"}, text


def protocol_job(body):
  from moejax.cache.policy import make_policy
  from moejax.model.sampler import SamplingParams
  from moejax.serve.worker import Job
  return Job([1, 2], SamplingParams(0.0, 1.0, body["max_tokens"], ()), 0,
             make_policy("quality"), [], 10.0, lambda *_: None)
