"""The package's layers (docs/architecture.md): a module imports only its own package and
the layers below it; no moejax/ folder holds more than MAX_MODULES modules.

Every module under moejax/, benchmarks/ and estimators/ (the checkout's alias) is parsed
with `ast` (imports inside
functions count too); nothing is imported.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_MODULES = 16   # a folder is one concept's rooms; past this it is split by concept

# Bottom first.  A module may import its own package and any package of a lower tier;
# packages of one tier are peers and import none of each other.
TIERS = (
    ("moejax.ggml",),                 # the floor: block formats, QuantArray (kernels read it)
    ("moejax.extras", "moejax.interrupts", "moejax.kernels", "moejax.estimators"),  # leaves
    ("moejax.model",),
    ("moejax.io", "moejax.cache", "moejax.train"),
    ("moejax.prefetch",),
    ("moejax.offload",),
    ("moejax.research", "moejax.estimators.data", "moejax.estimators.train"),
    ("moejax.cli", "moejax.api"),     # the programs; the Python API
    ("moejax.serve",),                # the server: runs as a program through moejax.cli.app
    ("moejax",),                      # the package root: its names load moejax.api lazily
    ("benchmarks",),                  # checkout-only: the logic of launch/bench_*.py
    ("launch", "estimators"),         # the checkout's entry scripts and estimators alias
)
RANK = {pkg: rank for rank, tier in enumerate(TIERS) for pkg in tier}
PROJECT = ("moejax", "estimators", "benchmarks", "launch")


def layer_of(dotted: str) -> str | None:
  """The longest package in RANK that `dotted` is (or is inside); None outside the project."""
  parts = dotted.split(".")
  if parts[0] not in PROJECT:
    return None
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in RANK:
      return ".".join(parts[:n])
  raise AssertionError(f"{dotted}: no layer in tests/test_architecture.py TIERS")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
  p = ROOT.joinpath(*dotted.split("."))
  return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(path: pathlib.Path, source: str | None = None):
  """(line, imported module) for every import in the file, at any depth."""
  name = module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  tree = ast.parse(path.read_text() if source is None else source, str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      for alias in node.names:   # `from moejax.io import traces` imports moejax.io.traces
        sub = f"{base}.{alias.name}"
        yield node.lineno, sub if _is_module(sub) else base


def violations(path: pathlib.Path, source: str | None = None) -> list[str]:
  own = layer_of(module_name(path))
  out = []
  for line, target in imports_of(path, source):
    dst = layer_of(target)
    if dst is None or dst == own:
      continue
    if RANK[dst] >= RANK[own]:
      where = "a peer" if RANK[dst] == RANK[own] else "a higher"
      out.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target} ({where} layer "
                 f"{dst}; see docs/architecture.md)")
  return out


def _modules(folders=("moejax", "estimators", "benchmarks")):
  return sorted(p for d in folders for p in (ROOT / d).rglob("*.py"))


def test_every_module_imports_only_lower_layers():
  paths = _modules()
  assert len(paths) > 50
  bad = [v for p in paths for v in violations(p)]
  assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_every_package_has_a_layer():
  for p in _modules():
    layer_of(module_name(p))


@pytest.mark.parametrize("source,expected", [
    ("from moejax.offload import engine\n", "moejax.model imports moejax.offload.engine (a higher"),
    ("def f():\n  import moejax.research.simulator as s\n",
     ":2: moejax.model imports moejax.research.simulator (a higher"),
    ("from moejax.io.traces import config_hash\n",
     "moejax.model imports moejax.io.traces (a higher"),
    ("from ..cache import policy\n", "moejax.model imports moejax.cache.policy (a higher"),
    ("from moejax.cli import app\n", "moejax.model imports moejax.cli.app"),
])
def test_a_forbidden_import_is_named_with_file_and_line(source, expected):
  path = ROOT / "moejax" / "model" / "routing.py"
  bad = violations(path, source)
  assert len(bad) == 1 and bad[0].startswith("moejax/model/routing.py:")
  assert expected in bad[0]


def test_peers_and_lower_layers():
  cache = ROOT / "moejax" / "cache" / "policy.py"
  assert violations(cache, "from moejax.io import traces\n")[0].endswith(
      "(a peer layer moejax.io; see docs/architecture.md)")
  assert not violations(cache, "import jax\nfrom moejax.model import routing\n"
                        "from moejax.cache import resident\nfrom . import resident\n")
  steps = ROOT / "moejax" / "prefetch" / "steps.py"
  assert not violations(steps, "from moejax.prefetch.estimator import estimate\n")
  assert violations(steps, "from moejax.estimators import train\n")   # training sits above
  # the root's lazy API names may load the API; nothing below may import the root's API
  assert not violations(ROOT / "moejax" / "__init__.py", "from moejax import api\n")
  assert violations(ROOT / "moejax" / "cli" / "app.py", "from moejax import api\n")


def test_moejax_never_imports_benchmarks_or_launch():
  # the product stands without the lab: benchmarks/ and launch/ stay out of the wheel
  bad = [f"{p.relative_to(ROOT)}:{line}: {target}" for p in _modules(("moejax", "estimators"))
         for line, target in imports_of(p) if target.split(".")[0] in ("benchmarks", "launch")]
  assert not bad, bad


def test_no_folder_has_more_than_max_modules():
  counts = {}
  for p in (ROOT / "moejax").rglob("*.py"):
    if p.name != "__init__.py":
      counts[p.parent.relative_to(ROOT)] = counts.get(p.parent.relative_to(ROOT), 0) + 1
  assert counts[pathlib.Path("moejax/offload")] > 5
  big = {str(d): n for d, n in counts.items() if n > MAX_MODULES}
  assert not big, f"folders with more than {MAX_MODULES} modules (split them by layer): {big}"


MAX_FUNCTION_LINES = 80   # past this a function is split into named steps


def long_functions(paths, root: pathlib.Path = ROOT) -> list[str]:
  """'file:line: name is N lines' for every function (or method) over MAX_FUNCTION_LINES."""
  out = []
  for p in paths:
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        if n > MAX_FUNCTION_LINES:
          out.append(f"{p.relative_to(root)}:{node.lineno}: {node.name} is {n} lines")
  return out


def test_no_function_in_moejax_is_longer_than_max_lines():
  bad = long_functions(_modules(("moejax",)))
  assert not bad, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
                   "steps):\n" + "\n".join(bad))


def test_a_long_function_is_named(tmp_path):
  body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  p = tmp_path / "probe.py"
  p.write_text(f"def short():\n  pass\n\n\nclass C:\n  def long(self):\n{body}\n")
  assert long_functions([p], tmp_path) == [f"probe.py:6: long is {MAX_FUNCTION_LINES + 1} lines"]


def import_graph(paths) -> dict[str, set[str]]:
  """{module: the project's modules it imports}, from every import in it (any depth)."""
  names = {module_name(p) for p in paths}
  return {module_name(p): {t for _, t in imports_of(p) if t in names and t != module_name(p)}
          for p in paths}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import circles of `graph`: its strongly connected components of more than one
  module (Tarjan's algorithm), each sorted."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def test_no_import_cycle_among_moejax_modules():
  cycles = import_cycles(import_graph(_modules(("moejax",))))
  assert not cycles, ("modules that import each other (move the shared piece down, or pass "
                      "it in):\n" + "\n".join(" <-> ".join(c) for c in cycles))


def test_an_import_cycle_is_found():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
  assert import_cycles(graph) == [["a", "b", "c"], ["d", "e"]]
