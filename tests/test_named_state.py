"""Named state on the decode path (issue 62, House IV): the modules a decoded token runs
through read multi-field state by name.  No `x[0]` of a tuple that a function returns, of
a loop's carry, of a table of tuples or of a tuple held on self, no NamedTuple unpacked by
position, no `._fields` order.  An array's row (`logits[0]`, a layer axis, `[..., 0]`) is
not a tuple and stays allowed.

Every module under moejax/ is parsed with `ast` (nothing is imported) to learn which
functions return a tuple (a tuple literal, a NamedTuple, another such function's result),
then the decode path's modules are checked.  The rules of tests/test_architecture.py
(layers, sizes) are its neighbours; this one is apart to keep each file one concept.
"""

import ast
import pathlib

import pytest

from tests.test_architecture import ROOT, _modules, module_name

DECODE_PATH = ("moejax/offload", "moejax/cache", "moejax/prefetch", "moejax/model/layer_stack.py",
               "moejax/model/routing.py", "moejax/model/sampler.py",
               "moejax/kernels/layer_view.py")
LOOPS = ("jax.lax.scan", "jax.lax.fori_loop", "jax.lax.while_loop")


def _body(fn):
  """The nodes of a function's own body, not of the functions defined inside it."""
  todo = list(ast.iter_child_nodes(fn))
  while todo:
    node = todo.pop()
    yield node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      todo.extend(ast.iter_child_nodes(node))


class _Module:
  """A module's names: its imports (local name -> dotted), functions, NamedTuple classes
  and tables of tuples (a module-level dict literal with a tuple value)."""

  def __init__(self, path: pathlib.Path, source: str | None = None):
    self.name, self.tree = module_name(path), ast.parse(source or path.read_text(), str(path))
    self.aliases = {}
    for node in ast.walk(self.tree):
      if isinstance(node, ast.Import):
        self.aliases.update({a.asname or a.name.split(".")[0]: a.name if a.asname
                             else a.name.split(".")[0] for a in node.names})
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        self.aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    top, self.funcs = self.tree.body, {}       # funcs: name -> its defs, at any depth
    for n in (n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)):
      self.funcs.setdefault(n.name, []).append(n)
    self.named = {f"{self.name}.{n.name}" for n in top if isinstance(n, ast.ClassDef)
                  and any(ast.unparse(b).endswith("NamedTuple") for b in n.bases)}
    self.tables = {t.id for n in top if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                   and any(isinstance(v, ast.Tuple) for v in n.value.values)
                   for t in n.targets if isinstance(t, ast.Name)}

  def dotted(self, node) -> str | None:
    """The dotted name a Name or attribute chain refers to (a function of this module
    defined at any depth, or a method called on self: this module's name and its own)."""
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id == "self" and node.attr in self.funcs):
      return f"{self.name}.{node.attr}"
    if isinstance(node, ast.Name):
      if node.id in self.funcs or f"{self.name}.{node.id}" in self.named:
        return f"{self.name}.{node.id}"
      return self.aliases.get(node.id)
    if isinstance(node, ast.Attribute):
      base = self.dotted(node.value)
      return base and f"{base}.{node.attr}"
    return None

  def tuple_valued(self, node, tuples: set[str]) -> bool:
    """Whether `node` gives a tuple: a tuple literal, a call of a tuple-returning
    function or of a NamedTuple class, an entry of a table of tuples."""
    if isinstance(node, ast.Tuple):
      return len(node.elts) > 1
    if isinstance(node, ast.IfExp):
      return self.tuple_valued(node.body, tuples) or self.tuple_valued(node.orelse, tuples)
    if isinstance(node, ast.Call):   # obj.m(): ".m", a method that returns a tuple in all classes
      f = node.func
      return (self.dotted(f) in tuples or (isinstance(f, ast.Attribute) and self.dotted(f) is None
                                          and f".{f.attr}" in tuples))
    return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and node.value.id in self.tables)


def tuple_functions(mods, named: bool = False) -> set[str]:
  """The dotted names of the functions (and NamedTuple classes) that return a tuple (a
  name defined twice in a module, e.g. two loop bodies: either returning one); named:
  only those that return a NamedTuple."""
  out = {n for m in mods for n in m.named}
  out |= set() if named else {"jax.lax.top_k", "jax.lax.scan", "jax.tree_util.tree_flatten"}
  gives = lambda m, v: (isinstance(v, ast.Call) and m.dotted(v.func) in out if named
                        else m.tuple_valued(v, out))
  returns = lambda m, fn: any(isinstance(n, ast.Return) and n.value is not None
                             and gives(m, n.value) for n in _body(fn))
  while True:
    more = {f"{m.name}.{name}" for m in mods for name, fns in m.funcs.items()
            if any(returns(m, fn) for fn in fns)}
    methods = {}
    for m in mods:
      for c in (c for c in ast.walk(m.tree) if isinstance(c, ast.ClassDef)):
        for fn in (f for f in c.body if isinstance(f, ast.FunctionDef)):
          methods[f".{fn.name}"] = methods.get(f".{fn.name}", True) and returns(m, fn)
    more = (more | {k for k, every in methods.items() if every}) - out
    if not more:
      return out
    out |= more


def _int_index(node) -> bool:
  s = node.slice.operand if isinstance(node.slice, ast.UnaryOp) else node.slice
  return isinstance(s, ast.Constant) and type(s.value) is int


def positional_reads(mod: _Module, tuples: set[str], records: frozenset = frozenset()):
  """'module:line: code (why)' for every integer index of a tuple in `mod`, and every
  NamedTuple (a call of one of `records`) unpacked by position."""
  carries = {id(a) if isinstance(a, ast.Lambda) else a.id for n in ast.walk(mod.tree)
             if isinstance(n, ast.Call) and mod.dotted(n.func) in LOOPS
             for a in n.args if isinstance(a, (ast.Lambda, ast.Name))}
  held = {n.targets[0].attr: n.lineno for n in ast.walk(mod.tree)     # self.x = a tuple
          if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Attribute)
          and ast.unparse(n.targets[0].value) == "self" and mod.tuple_valued(n.value, tuples)}
  out = []
  scopes = [mod.tree] + [n for n in ast.walk(mod.tree)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
  for scope in scopes:
    named = {}                                   # a name bound to a tuple here -> why
    if not isinstance(scope, ast.Module):
      loop = id(scope) in carries or getattr(scope, "name", None) in carries
      for a in scope.args.args:
        if loop:
          named[a.arg] = "a loop's carry"
        elif a.annotation is not None and ast.unparse(a.annotation).startswith("tuple"):
          named[a.arg] = "a tuple parameter"
    for n in _body(scope):
      if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
          and mod.tuple_valued(n.value, tuples)):
        named[n.targets[0].id] = f"bound at line {n.lineno} to a tuple"
    for n in _body(scope):
      why = None
      if isinstance(n, ast.Attribute) and n.attr == "_fields":
        why = "a NamedTuple's field order"
      elif (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)
            and isinstance(n.value, ast.Call) and mod.dotted(n.value.func) in records):
        why = "a NamedTuple unpacked"
      elif isinstance(n, ast.Subscript) and _int_index(n):
        if isinstance(n.value, ast.Name) and n.value.id in named:
          why = named[n.value.id]
        elif mod.tuple_valued(n.value, tuples):
          why = "a tuple result"
        elif isinstance(n.value, ast.Attribute) and ast.unparse(n.value.value) == "self" \
            and n.value.attr in held:
          why = f"set at line {held[n.value.attr]} to a tuple"
      if why:
        out.append(f"{mod.name}:{n.lineno}: {ast.unparse(n)} ({why})")
  return sorted(out)


def _decode_path():
  paths = [p for d in DECODE_PATH for p in ([ROOT / d] if d.endswith(".py")
                                            else sorted((ROOT / d).rglob("*.py")))]
  assert all(p.is_file() for p in paths), f"DECODE_PATH names a module that is gone: {paths}"
  return paths


def test_the_decode_path_reads_state_by_name():
  mods = [_Module(p) for p in _modules(("moejax",))]
  tuples, named = tuple_functions(mods), frozenset(tuple_functions(mods, named=True))
  bad = [v for p in _decode_path() for v in positional_reads(_Module(p), tuples, named)]
  assert not bad, ("multi-field tuples read by position on the decode path (make them a "
                   "NamedTuple or dataclass and read the field by name):\n" + "\n".join(bad))


@pytest.mark.parametrize("source,found", [
    ("from moejax.model import routing\ndef f(cfg, x):\n  return routing.route(cfg, x)[0]\n",
     "routing.route(cfg, x)[0] (a tuple result)"),
    ("RULES = {'a': (f, g)}\ndef h(c):\n  return RULES[c][1]\n", "RULES[c][1] (a tuple result)"),
    ("import jax\ndef f(x, n):\n  return jax.lax.while_loop(lambda c: ~c[1], g, (0, x))\n",
     "c[1] (a loop's carry)"),
    ("def of(x):\n  return (x, 1)\ndef g(x):\n  v = of(x)\n  return v[-1]\n",
     "v[-1] (bound at line 4 to a tuple)"),
    ("def f(pair: tuple[int, int]):\n  return pair[0]\n", "pair[0] (a tuple parameter)"),
    ("class A:\n  def f(self, x):\n    self.c = (x, x)\n    return self.c[1]\n",
     "self.c[1] (set at line 3 to a tuple)"),
    ("class M:\n  def split(self, x):\n    return x, x\ndef f(m, x):\n  return m.split(x)[1]\n",
     "m.split(x)[1] (a tuple result)"),
    ("from moejax.model import routing\ndef f(cfg, x):\n  ids, gates, _ = routing.route(cfg, x)\n",
     "ids, gates, _ = routing.route(cfg, x) (a NamedTuple unpacked)"),
    ("def f(r):\n  return r._fields\n", "r._fields (a NamedTuple's field order)"),
])
def test_a_positional_read_is_found(source, found):
  mods = [_Module(ROOT / "moejax" / "cache" / "probe.py", source),
          _Module(ROOT / "moejax" / "model" / "routing.py")]
  reads = positional_reads(mods[0], tuple_functions(mods),
                           frozenset(tuple_functions(mods, named=True)))
  assert [r.split(": ", 1)[1] for r in reads] == [found]


def test_array_rows_are_not_positional_reads():
  source = ("import jax\ndef f(logits, x):\n  y = jax.numpy.zeros(3)\n"
            "  return logits[0], x.shape[0], y[..., 0], y[0], (logits, x)[0]\n")
  mod = _Module(ROOT / "moejax" / "cache" / "probe.py", source)
  assert positional_reads(mod, tuple_functions([mod])) == [
      "moejax.cache.probe:4: (logits, x)[0] (a tuple result)"]
