"""Ctrl-C stops the server at once, with one line and exit 130 (issue 62, a newcomer's
item 10).

The fault: uvicorn's own SIGINT handling waited for every open connection (a stream
still decoding, a keep-alive client) and then exited 0 with nothing printed: 4.07 s on
the first server.  Now a running request is ended (its stream gets an error event
`shutting_down`, then [DONE]), the engine stops at its next token, and the process ends
as the project's other commands do (moejax/cli/app.py)."""

import http.client
import json
import os
import signal
import subprocess
import sys

import pytest

from benchmarks.serve_client import start_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")


@pytest.mark.parametrize("batch", [1, 4])
def test_ctrl_c_ends_running_streams_and_exits_130_with_one_line(batch):
  proc, url = start_server(DEMO, 16, "quality", max_len=256, extra=[f"--max_batch={batch}"])
  try:
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = dict(model="demo", prompt="def f(x):", max_tokens=240, stream=True,
                temperature=0)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    while b'"text"' not in r.readline():    # decoding: its first text has come
      pass
    idle = http.client.HTTPConnection(host, int(port), timeout=120)   # a keep-alive client
    idle.request("GET", "/health")
    assert idle.getresponse().read()
    proc.send_signal(signal.SIGINT)
    rest = r.read().decode()
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGINT)
  # the stream was ended, not cut: an error event, then [DONE]
  assert "shutting_down" in rest and rest.rstrip().endswith("data: [DONE]"), rest[-500:]
  assert proc.wait(60) == 130
  proc.log_reader.join(30)
  err = "".join(proc.log)
  assert err.rstrip().splitlines()[-1] == "python -m launch.serve: interrupted", err
  assert "Traceback" not in err, err


def test_ctrl_c_while_loading_exits_130_with_one_line():
  proc = subprocess.Popen([sys.executable, "-m", "launch.serve", f"--model_dir={DEMO}",
                           "--port=0", "--max_len=64"], cwd=REPO, stderr=subprocess.PIPE,
                          text=True)
  try:
    for line in proc.stderr:                # listening, loading in the engine's thread
      if "loading ..." in line:
        break
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.wait(60) == 130, err
  lines = [l for l in err.splitlines() if l.strip()]
  assert lines and lines[-1] == "python -m launch.serve: interrupted", err
  assert "Traceback" not in err, err
