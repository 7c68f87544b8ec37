"""Access control (issue 47 item 4): an API key on every route but /health, the warning
for a server open beyond loopback without one, and --norequest_policies; with the openai
client against a server started here."""

import os
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.test_serve import DEMO, PROMPT, REPO, Server, _env  # noqa: E402

KEY = "sk-moejax-test-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  # the key from the environment variable; a fixed policy (--norequest_policies)
  s = Server(tmp_path_factory.mktemp("access"), args=["--norequest_policies",
                                                      "--policy=quality"],
             env={"MOEJAX_API_KEY": KEY}, key=KEY)
  try:
    yield s
  finally:
    s.stop()


def client(server, key):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key", ["wrong", KEY[:-1], KEY + "0", ""])
def test_a_wrong_or_missing_key_gets_401(server, key):
  c = client(server, key or "unused")
  if not key:      # the openai client always sends a key: send none by hand
    r = httpx.post(server.url + "/v1/completions", json=dict(model="demo", prompt=PROMPT))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert "didn't provide an API key" in r.json()["error"]["message"]
    return
  with pytest.raises(openai.AuthenticationError) as e:
    c.completions.create(model="demo", prompt=PROMPT, max_tokens=2)
  assert e.value.status_code == 401
  assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == \
      "invalid_request_error"
  with pytest.raises(openai.AuthenticationError):
    c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
  with pytest.raises(openai.AuthenticationError):
    c.models.list()


def test_every_route_but_health_needs_the_key(server):
  assert httpx.get(server.url + "/health").status_code == 200
  for path in ("/metrics", "/v1/models", "/nowhere"):
    assert httpx.get(server.url + path).status_code == 401, path
    r = httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == (404 if path == "/nowhere" else 200), path
  r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Basic {KEY}"})
  assert r.status_code == 401
  text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
  assert 'moejax_http_responses_total{code="401"}' in text


def test_the_right_key_is_served(server):
  c = server.client()
  assert [m.id for m in c.models.list().data] == ["demo"]
  r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
  assert r.usage.completion_tokens == 3
  chat = c.chat.completions.create(model="demo", max_tokens=2, temperature=0,
                                   messages=[{"role": "user", "content": "fibonacci"}])
  assert chat.choices[0].message.content is not None


def test_without_request_policies_the_policy_fields_are_ignored(server):
  c = server.client()
  plain = c.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0)
  asked = c.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0,
                               extra_body={"moejax": {"policy": "baseline", "tau": 0.3,
                                                      "eviction": "lfu"}})
  use = asked.usage.model_extra["moejax"]
  assert use["policy"] == plain.usage.model_extra["moejax"]["policy"]
  assert use["policy"].startswith("quality"), use["policy"]
  assert use["ignored"] == ["moejax.policy", "moejax.tau", "moejax.eviction"]
  assert "ignored" not in plain.usage.model_extra["moejax"]
  assert asked.choices[0].text == plain.choices[0].text
  # a policy that does not exist is ignored too (it is not read); timeout_s still applies,
  # and an unknown field is still a 400
  r = c.completions.create(model="demo", prompt=PROMPT, max_tokens=2,
                           extra_body={"moejax": {"policy": "fastest", "timeout_s": 60}})
  assert r.usage.model_extra["moejax"]["ignored"] == ["moejax.policy"]
  with pytest.raises(openai.BadRequestError, match="not a known field"):
    c.completions.create(model="demo", prompt=PROMPT, max_tokens=2,
                         extra_body={"moejax": {"polcy": "speed"}})


def _start_lines(tmp_path, args, env=None):
  """The server's first stderr lines, up to the one after 'loading ...'; then it ends."""
  env = dict(_env(tmp_path), **(env or {}))
  proc = subprocess.Popen([sys.executable, "-m", "launch.serve", f"--model_dir={DEMO}",
                           "--port=0", "--max_len=32", *args], cwd=REPO, env=env,
                          stderr=subprocess.PIPE, text=True)
  lines = []
  try:
    deadline = time.time() + 120
    for line in proc.stderr:
      lines.append(line)
      if "loading ..." in line or time.time() > deadline:
        break
    time.sleep(1.0)    # what is printed right after
    proc.terminate()
    _, rest = proc.communicate(timeout=60)
    return "".join(lines) + (rest or "")
  finally:
    if proc.poll() is None:
      proc.kill()


def test_listening_beyond_loopback_without_a_key_warns(tmp_path):
  out = _start_lines(tmp_path, ["--host=0.0.0.0"])
  assert "WARNING: listening on 0.0.0.0" in out and "--api_key" in out, out
  out = _start_lines(tmp_path, ["--host=0.0.0.0"], {"MOEJAX_API_KEY": KEY})
  assert "loading ..." in out and "WARNING" not in out, out
  out = _start_lines(tmp_path, ["--host=127.0.0.1"])
  assert "loading ..." in out and "WARNING" not in out, out


def test_the_guard():
  from moejax.serve import auth
  g = auth.Guard(KEY)
  scope = lambda path, *h: {"path": path, "headers": list(h)}
  assert g.check(scope("/health")) is None
  assert g.check(scope("/v1/models", (b"authorization", f"Bearer {KEY}".encode()))) is None
  assert g.check(scope("/v1/models", (b"Authorization", f"bearer  {KEY}".encode()))) is None
  for h in ((b"authorization", b"Bearer"), (b"authorization", KEY.encode()),
            (b"x-api-key", KEY.encode())):
    assert g.check(scope("/v1/models", h)).status == 401, h
  assert auth.Guard(None).check(scope("/metrics")) is None
  assert auth.resolve_key(None) == os.environ.get(auth.ENV) or None
  assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1")
  assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("example.com")


def test_a_spin_time_that_is_not_a_number_is_a_one_line_usage_error(tmp_path):
  env = dict(_env(tmp_path), MOEJAX_CPU_SPIN_US="1ms")
  proc = subprocess.run([sys.executable, "-m", "launch.serve", f"--model_dir={DEMO}",
                         "--port=0"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert "MOEJAX_CPU_SPIN_US must be microseconds >= 0, got '1ms'" in proc.stderr
