"""The README is a manual that works: its Python example runs, every command it names
starts, every relative link in it and in docs/ resolves, and nothing points outside the
repository; the lab record (docs/lab/) has an index line for each of its run folders."""

import concurrent.futures
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def markdown_files():
  out = [README]
  for root, _, names in os.walk(os.path.join(REPO, "docs")):
    out += [os.path.join(root, n) for n in names if n.endswith(".md")]
  return out


def python_blocks(text):
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_is_a_short_manual():
  text = read(README)
  assert len(text.splitlines()) <= 250, len(text.splitlines())
  for heading in ("## Quick start: two commands", "## Run your own checkpoint", "## Concepts",
                  "## Python API", "## Tests"):
    assert heading in text, heading
  setup = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
  commands = [l.split("#")[0].strip() for l in setup.splitlines() if l.strip()]
  assert commands == ["bash launch/demo.sh", "bash launch/test.sh"], commands


def test_readme_python_example_runs_on_the_demo_model(tmp_path):
  blocks = python_blocks(read(README))
  assert len(blocks) == 1, "one Python API example"
  script = tmp_path / "example.py"
  script.write_text(blocks[0])
  env = dict(os.environ, PYTHONPATH=REPO)
  r = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  m = re.search(r"hit rate ([\d.]+)%, ([\d.]+) ms a token", r.stdout)
  assert m, r.stdout
  assert 0 < float(m.group(1)) < 100 and float(m.group(2)) > 0


def launch_modules_named():
  text = read(README)
  names = set(re.findall(r"launch\.([a-z]\w*)", text))
  # a table cell lists benches by their short names after the first `launch.bench_offload`
  names |= {n for n in re.findall(r"`(bench_\w+)`", text)}
  return sorted(names)


def test_every_command_the_readme_names_exists():
  names = launch_modules_named()
  assert {"generate", "demo", "emulate", "simulate", "study"} <= set(names), names
  missing = [n for n in names if not os.path.exists(os.path.join(REPO, "launch", n + ".py"))]
  assert not missing, missing


def _help(name):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", f"launch.{name}", "--help"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  return name, r.returncode, (r.stdout + r.stderr)[-800:]


def test_every_command_the_readme_names_starts():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(_help, launch_modules_named()))
  bad = [(n, rc, out) for n, rc, out in results if rc != 0 or "--" not in out]
  assert not bad, bad


def test_relative_links_resolve():
  broken = []
  for path in markdown_files():
    for target in re.findall(r"\]\(([^)\s]+)\)", read(path)):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      file = target.split("#")[0]
      if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), file))):
        broken.append((os.path.relpath(path, REPO), target))
  assert not broken, broken


def test_docs_stand_alone():
  # the project stands alone: nothing in the README or docs points outside the repository
  for path in markdown_files():
    assert "../shared" not in read(path), path



def test_the_lab_index_lists_every_run_folder():
  # docs/lab/README.md: one line per folder of docs/lab/runs, linking it
  index = read(os.path.join(REPO, "docs", "lab", "README.md"))
  runs = os.path.join(REPO, "docs", "lab", "runs")
  missing = [d for d in sorted(os.listdir(runs))
             if os.path.isdir(os.path.join(runs, d)) and f"](runs/{d}/" not in index]
  assert not missing, missing


def test_engine_md_states_the_codes_order_of_admissions_and_trim():
  # the bug: docs/engine.md's per-layer steps trimmed before the admissions; the code
  # (cache/step.py policy_tail) inserts the admissions, then trims with them evicted last
  import moejax.cache.step as step
  engine_md = read(os.path.join(REPO, "docs", "engine.md"))
  section = engine_md.split("## The one per-layer function", 1)[1].split("\n## ", 1)[0]
  for name, text in (("docs/engine.md", section), ("cache/step.py", step.__doc__)):
    steps = dict(re.findall(r"^ *(\d)\. (.*)$", text, flags=re.M))
    assert "admission" in steps["5"] and "trim" in steps["6"], (name, steps)
    assert "evicted" in " ".join(text.split()).split("6. trim", 1)[1][:200], name


def test_readme_results_keep_one_current_figure_a_row():
  # the bug: the results table had grown into a lab diary (one row held eleven figures
  # from four runs); the README keeps the latest figure, docs/results.md every earlier one
  text = read(README)
  section = text.split("## Results\n", 1)[1].split("\n## ", 1)[0]
  rows = [l.split(" | ") for l in section.splitlines() if l.startswith("| ")][2:]
  assert len(rows) >= 5
  for question, result, *_ in rows:
    assert len(result) <= 90 and ";" not in result, (question, result)
  history = read(os.path.join(REPO, "docs", "results.md"))
  assert "## Every figure the README has shown" in history
  assert "docs/results.md#every-figure-the-readme-has-shown" in section
