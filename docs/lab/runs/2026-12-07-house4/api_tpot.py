"""Issue 62: the README's Python API example against `moejax-generate` on the same settings
(the demo model, quality, 25% resident, the prompt "def fibonacci(n):", 32 new tokens),
interleaved A B A B; each prints its time per token.  Usage (from the repository root):

  PYTHONPATH=. python docs/lab/runs/2026-12-07-house4/api_tpot.py ROUNDS OUT.json
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def readme_example() -> str:
  text = open(os.path.join(ROOT, "README.md")).read()
  return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def run(cmd) -> float:
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  if r.returncode:
    raise SystemExit(r.stderr[-2000:])
  m = (re.search(r"([\d.]+) ms a token", r.stdout)
       or re.search(r"time per token\s+([\d.]+) ms", r.stdout + r.stderr))
  if not m:
    raise SystemExit(f"no time per token in the output of {cmd}:\n{r.stdout[-2000:]}")
  return float(m.group(1))


def main():
  rounds, out = int(sys.argv[1]), sys.argv[2]
  api = [sys.executable, "-c", readme_example()]
  cli = [sys.executable, "-m", "launch.generate", "--model_dir=ckpts/demo", "--policy=quality",
         "--cache_fraction=0.25", "--prompt=def fibonacci(n):", "--max_new_tokens=32"]
  res = {"api_ms": [], "generate_ms": [], "loadavg": []}
  for _ in range(rounds):
    res["api_ms"].append(run(api))
    res["generate_ms"].append(run(cli))
    res["loadavg"].append(os.getloadavg()[0])
  res["ratios"] = [a / g for a, g in zip(res["api_ms"], res["generate_ms"])]
  json.dump(res, open(out, "w"), indent=2)
  print(json.dumps(res, indent=2))


if __name__ == "__main__":
  main()
