"""launch.serve with the official openai client, against a server started here on
127.0.0.1 (the demo model, a chat template added in a copy of its folder)."""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")
PROMPT = "def fibonacci(n):"
N = 12                   # new tokens of the comparisons
MAX_LEN = 64             # the server's KV cache: launch.generate's for PROMPT + N tokens
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}def{% endif %}")


def _env(tmp):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
  env.pop("MOEJAX_API_KEY", None)         # no key unless a test sets one
  # one XLA compilation cache for the server and the launch.generate runs (test.sh's, if set)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp / "xla-cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
  return env


def _generate(env, policy):
  return subprocess.Popen(
      [sys.executable, "-m", "launch.generate", f"--prompt={PROMPT}", f"--max_new_tokens={N}",
       f"--policy={policy}", "--nostream", "--noprogress"], cwd=REPO, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Server:
  """A server on 127.0.0.1; args: more flags; env: more environment; key: the client's
  API key."""

  def __init__(self, tmp, args=(), env=None, key="none"):
    self.key = key
    model = tmp / "demo"
    model.mkdir()
    for name in os.listdir(DEMO):
      os.symlink(os.path.join(DEMO, name), model / name)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    self.env = dict(_env(tmp), **(env or {}))
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "launch.serve", f"--model_dir={model}", "--port=0",
         f"--max_len={MAX_LEN}", "--warm_prompt_tokens=16", "--max_queue=4",
         "--request_timeout_s=120", *args], cwd=REPO, env=self.env, stderr=subprocess.PIPE,
        text=True)
    self.log, self.url = [], None
    found = threading.Event()

    def read():
      for line in self.proc.stderr:
        self.log.append(line)
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if m and self.url is None:
          self.url = m.group(1)
          found.set()
    threading.Thread(target=read, daemon=True).start()
    try:
      assert found.wait(120), "".join(self.log)
      deadline = time.time() + 400
      while time.time() < deadline:
        assert self.proc.poll() is None, "".join(self.log)
        if httpx.get(self.url + "/health").status_code == 200:
          break
        time.sleep(0.5)
      else:
        raise AssertionError("no /health 200: " + "".join(self.log))
    except BaseException:
      self.proc.kill()        # a server that never came up is not left running
      raise

  def stop(self):
    """Ends the server (killed if it has not ended 30 s after SIGTERM)."""
    self.proc.terminate()
    try:
      self.proc.wait(30)
    except subprocess.TimeoutExpired:
      self.proc.kill()

  def client(self, **kw):
    return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, **kw)

  def rss_mb(self) -> float:
    with open(f"/proc/{self.proc.pid}/status") as f:
      return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024

  def metric(self, name: str) -> float:
    text = httpx.get(self.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = Server(tmp_path_factory.mktemp("serve"))
  s.cli = {}
  try:       # the server ends whatever fails here, so that no failed setup leaves it running
    # the first request meets the resident sets launch.generate starts from
    s.first = s.client().completions.create(model="demo", prompt=PROMPT, max_tokens=N,
                                            temperature=0)
    s.cli = {p: _generate(s.env, p) for p in ("quality", "baseline")}
    yield s
  finally:
    for p in s.cli.values():
      p.kill()
    s.stop()


def baseline(**kw):
  return dict(extra_body={"moejax": {"policy": "baseline"}}, **kw)


def test_models_and_health(server):
  assert [m.id for m in server.client().models.list().data] == ["demo"]
  assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_greedy_output_equals_launch_generate(server):
  c = server.client()
  exact = c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                               **baseline())
  for policy, resp in (("quality", server.first), ("baseline", exact)):
    out, err = server.cli[policy].communicate(timeout=400)
    assert server.cli[policy].returncode == 0, err[-2000:]
    assert out == PROMPT + resp.choices[0].text + "\n", (policy, out, resp.choices[0].text)
    assert resp.usage.completion_tokens == N


def test_streaming_equals_non_streaming_with_usage(server):
  c = server.client()
  whole = c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                               **baseline())
  chunks = list(c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                                     stream=True, stream_options={"include_usage": True},
                                     **baseline()))
  text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
  assert len(chunks) > 3 and text == whole.choices[0].text
  assert chunks[-2].choices[0].finish_reason == "length"
  usage = chunks[-1].usage
  assert not chunks[-1].choices and usage.completion_tokens == N
  assert usage.model_extra["moejax"]["policy"].startswith("baseline")
  assert usage.model_extra["moejax"]["tpot_ms"] > 0


def test_stop_sequences(server):
  c = server.client()
  full = c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                              **baseline()).choices[0].text
  stop = full.strip()[2:6]
  want = full[:full.index(stop)]
  r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                           stop=[stop, "@@never@@"], **baseline())
  assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
  chunks = c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                                stop=stop, stream=True, **baseline())
  parts = [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in chunks]
  assert "".join(t for t, _ in parts) == want and parts[-1][1] == "stop"


def test_a_request_policy_changes_the_statistics(server):
  c = server.client()
  stats = {}
  for policy in ("baseline", "quality", "baseline"):
    r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=N, temperature=0,
                             extra_body={"moejax": {"policy": policy}})
    stats[policy] = r.usage.model_extra["moejax"]
  assert stats["baseline"]["policy"].startswith("baseline")
  assert stats["baseline"]["substituted_call_pct"] == 0
  assert stats["quality"]["substituted_call_pct"] > 0
  assert stats["quality"]["substituted_mass_per_token"] > 0
  for s in stats.values():
    assert 0 < s["hit_rate"] < 1 and s["link"].startswith("scaled")
  # tau only applies to the threshold rule
  with pytest.raises(openai.BadRequestError, match="tau"):
    c.completions.create(model="demo", prompt=PROMPT, max_tokens=2,
                         extra_body={"moejax": {"policy": "baseline", "tau": 0.3}})


def test_sampling_is_seeded(server):
  c = server.client()
  kw = dict(model="demo", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
            **baseline())
  a, b = (c.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
  others = {c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
  assert a == b and len(others | {a}) > 1


def test_chat_uses_the_checkpoint_template(server):
  c = server.client()
  msgs = [{"role": "user", "content": "fibonacci"}]
  r = c.chat.completions.create(model="demo", messages=msgs, max_tokens=6, temperature=0,
                                **baseline())
  from moejax.io.tokenizer import Tokenizer
  rendered = "# user: fibonacci\ndef"
  assert r.usage.prompt_tokens == len(Tokenizer(DEMO).encode(rendered))
  assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
  chunks = list(c.chat.completions.create(model="demo", messages=msgs, max_tokens=6,
                                          temperature=0, stream=True, **baseline()))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
      r.choices[0].message.content


@pytest.mark.parametrize("field,value,match", [
    ("model", "gpt-4", "does not exist"),
    ("max_tokens", -3, "max_tokens"),
    ("moejax", {"policy": "fastest"}, "unknown policy"),
    ("moejax", {"cache_fraction": 0.5}, "launch setting"),
    ("prompt", "x " * 200, "maximum context length"),
    ("n", 2, "not supported"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, field, value, match):
  c = server.client()
  body = dict(model="demo", prompt=PROMPT, max_tokens=4)
  extra = {}
  if field in ("model", "max_tokens", "prompt", "n"):
    body[field] = value
  else:
    extra = {field: value}
  with pytest.raises(openai.BadRequestError, match=match) as e:
    c.completions.create(extra_body=extra, **body)
  assert e.value.body["type"] == "invalid_request_error"
  assert c.completions.create(model="demo", prompt=PROMPT, max_tokens=2).choices[0].text


def test_malformed_json_gets_400(server):
  r = httpx.post(server.url + "/v1/completions", content=b"{\"model\": ",
                 headers={"Content-Type": "application/json"})
  assert r.status_code == 400 and "parse the JSON" in r.json()["error"]["message"]
  assert httpx.get(server.url + "/nowhere").json()["error"]["code"] == "404"
  assert server.client().completions.create(model="demo", prompt=PROMPT, max_tokens=2)


def test_a_client_that_disconnects_cancels_its_request(server):
  before = server.metric('moejax_requests_total{outcome="cancelled"}')
  body = dict(model="demo", prompt=PROMPT, max_tokens=MAX_LEN - 10, temperature=0,
              stream=True, moejax={"policy": "baseline"})
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    for line in r.iter_lines():
      if line.startswith("data:"):
        break             # one chunk, then the connection closes
  deadline = time.time() + 30
  while server.metric('moejax_requests_total{outcome="cancelled"}') <= before:
    assert time.time() < deadline, "the disconnected request was not cancelled"
    time.sleep(0.1)
  r = server.client().completions.create(model="demo", prompt=PROMPT, max_tokens=N,
                                         temperature=0, **baseline())
  assert r.usage.completion_tokens == N


def test_a_request_timeout_ends_it(server):
  c = server.client()
  with pytest.raises(openai.APIStatusError, match="timed out") as e:
    c.completions.create(model="demo", prompt=PROMPT, max_tokens=MAX_LEN - 10,
                         extra_body={"moejax": {"timeout_s": 0.001}})
  assert e.value.status_code == 504
  assert c.completions.create(model="demo", prompt=PROMPT, max_tokens=2).choices[0].text


def test_a_stream_timeout_is_an_error_event(server):
  # a stream's headers are sent when it is queued (docs/serve.md): a timeout is an event
  body = dict(model="demo", prompt=PROMPT, max_tokens=MAX_LEN - 10, stream=True,
              moejax={"timeout_s": 0.001})
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  assert json.loads(events[-2])["error"]["code"] == "timeout", events
  assert server.client().completions.create(model="demo", prompt=PROMPT,
                                            max_tokens=2).choices[0].text


def test_load_every_request_completes_or_gets_429(server):
  done, rss, lock = [], {}, threading.Lock()

  def client_run(i):
    c = server.client(timeout=120)
    out = []
    for j in range(20):
      try:
        r = c.completions.create(model="demo", prompt=f"{PROMPT} # {i} {j}", max_tokens=4,
                                 temperature=0)
        out.append(r.choices[0].finish_reason)
      except openai.RateLimitError as e:
        assert int(e.response.headers["Retry-After"]) >= 1
        out.append("429")
      with lock:
        done.append(1)
        if len(done) in (40, 120):
          rss[len(done)] = server.rss_mb()
    return out

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = [x for r in pool.map(client_run, range(8), timeout=600) for x in r]
  assert len(results) == 160 and set(results) <= {"length", "stop", "429"}, set(results)
  assert results.count("429") < 160 and "429" in results or results.count("length") == 160
  grown = server.rss_mb() - rss[40]
  assert grown <= 32, (rss, grown)
  assert server.metric("moejax_queue_depth") == 0
  assert server.metric('moejax_requests_total{outcome="rejected"}') == results.count("429")


def test_without_a_chat_template_chat_is_refused():
  from starlette.testclient import TestClient
  from moejax.cache.policy import make_policy
  from moejax.io.tokenizer import Tokenizer
  from moejax.serve import app as app_lib, metrics, protocol
  from moejax.serve.worker import Worker
  worker = Worker(lambda: None, metrics.Metrics())      # not started: still "loading"
  limits = protocol.Limits("demo", 64, 10.0, make_policy("quality"), (0,))
  client = TestClient(app_lib.create_app(worker, limits, metrics.Metrics(), Tokenizer(DEMO),
                                         None))
  assert client.get("/health").status_code == 503
  r = client.post("/v1/completions", json={"model": "demo", "prompt": "x"})
  assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
  worker.ready.set()
  r = client.post("/v1/chat/completions", json={"model": "demo", "messages": [
      {"role": "user", "content": "hi"}]})
  assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
