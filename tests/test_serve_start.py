"""The server's start: what it compiles before it says ready, how /metrics times a
request, and the line a missing serve extra prints (issue 62, a newcomer's items 2 and 3).

The faults: the first batch after "ready" compiled the sampler, the joins' KV-cache write
and unwarmed prompt buckets while the batch waited (5.6 s a request against 0.7 s later);
/metrics' TTFT started at the request's prompt pass, not at its arrival (0.146 s where the
clients waited seconds); the missing-extra hint said a bare `pip`, whichever Python that
is."""

import json
import os
import shlex
import subprocess
import sys
import threading
import urllib.request

import pytest

from benchmarks.serve_client import scrape_metrics, start_server
from moejax.serve import warm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "ckpts", "demo")
# prompts in three buckets (16, 32, 64), greedy and OpenAI's default sampling
JOBS = [("def f(x):", 0.0), ("def f(x):", 1.0),
        ("import os\nimport sys\n\n\ndef read_config(path, default=None):\n  '''", 0.0),
        ("# " + "parse the command line and read the configuration file " * 3, 1.0)]


def test_the_install_hint_names_the_running_python():
  from moejax.serve import main
  hint = main.install_hint()
  assert hint.startswith(shlex.quote(sys.executable) + " -m pip install "), hint
  assert "[serve]" in hint, hint


def test_a_missing_serve_extra_is_one_line_naming_this_pythons_pip():
  code = ("import sys; sys.modules['uvicorn'] = None; sys.argv = ['moejax-serve']; "
          "from moejax.serve import main; main.entry()")
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
  assert p.returncode == 1, p.stderr
  want = f"{shlex.quote(sys.executable)} -m pip install -e '.[serve]'"
  assert "uvicorn" in p.stderr and want in p.stderr, p.stderr
  assert "Traceback" not in p.stderr, p.stderr


def test_warm_prompt_lengths():
  assert warm.prompt_lengths(["all"], 2048) == [16, 32, 64, 128, 256, 512, 1024, 2047]
  assert warm.prompt_lengths(["all"], 64) == [16, 32, 63]
  assert warm.prompt_lengths(["16", "100", "0"], 64) == [16]
  with pytest.raises(ValueError, match="'sixteen'"):
    warm.prompt_lengths(["sixteen"], 64)


def completion(url: str, prompt: str, temperature: float) -> dict:
  body = json.dumps(dict(model="demo", prompt=prompt, max_tokens=8, temperature=temperature,
                         seed=1)).encode()
  req = urllib.request.Request(url + "/v1/completions", body,
                               {"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=300) as r:
    return json.loads(r.read())["usage"]["moejax"]


def first_batch(url: str) -> list[dict]:
  """JOBS sent at once, as soon as the server is ready -> their usage.moejax."""
  out: list = [None] * len(JOBS)
  barrier = threading.Barrier(len(JOBS))

  def one(i):
    barrier.wait()
    out[i] = completion(url, *JOBS[i])
  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(JOBS))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(out), out
  return out


@pytest.mark.parametrize("args", [["--max_batch=1"], ["--max_batch=4"],
                                  ["--max_batch=4", "--policy=none"]])
def test_the_first_batch_compiles_nothing_and_metrics_count_from_arrival(args):
  policy = args[-1].split("=")[1] if args[-1].startswith("--policy") else "quality"
  proc, url = start_server(DEMO, "all", policy, max_len=64,
                           extra=[a for a in args if not a.startswith("--policy")])
  try:
    usage = first_batch(url)
    m = scrape_metrics(url)
  finally:
    proc.terminate()
    proc.wait(60)
  assert m["moejax_programs_compiled_total"] == 0, m
  # from arrival: the queue, a policy's compile, the prompt pass to the first token, each
  # request's own parts as usage.moejax reports them (rounded to 1 us)
  parts = sum(u["queue_ms"] + u["compile_ms"] + u["ttft_ms"] for u in usage) / 1e3
  assert m["moejax_time_to_first_token_seconds_count"] == len(JOBS)
  assert abs(m["moejax_time_to_first_token_seconds_sum"] - parts) < 1e-4 * len(JOBS), (m, usage)
  assert sum(u["queue_ms"] for u in usage) > 0, usage
  assert m["moejax_request_latency_seconds_count"] == len(JOBS)
  assert m["moejax_request_latency_seconds_sum"] > m["moejax_time_to_first_token_seconds_sum"]


@pytest.mark.parametrize("batch", [1, 4])
def test_warm_policies_are_compiled_before_ready(batch):
  """--warm_policies: a request's first use of one compiles nothing (issue 62: the first
  `speed` request reported compile_ms 11160)."""
  proc, url = start_server(DEMO, "16", "quality", max_len=32,
                           extra=[f"--max_batch={batch}", "--warm_policies=baseline"])
  try:
    body = json.dumps(dict(model="demo", prompt="def f(x):", max_tokens=4, temperature=0,
                           moejax={"policy": "baseline"})).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
      usage = json.loads(r.read())["usage"]["moejax"]
    m = scrape_metrics(url)
  finally:
    proc.terminate()
    proc.wait(60)
  assert usage["policy"].startswith("baseline") and usage["compile_ms"] == 0, usage
  assert m["moejax_programs_compiled_total"] == 0 and m["moejax_policy_compiles_total"] == 0, m
  assert any("[moejax] compiled baseline" in line for line in proc.log), proc.log


def test_warm_policies_need_an_offload_policy():
  p = subprocess.run([sys.executable, "-m", "launch.serve", f"--model_dir={DEMO}", "--port=0",
                      "--policy=none", "--warm_policies=speed"], cwd=REPO, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 2 and "--warm_policies" in p.stderr, p.stderr
