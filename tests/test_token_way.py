"""One token's way through the package: the modules on the call stack from `moejax.generate`
to the two places where a decoded token's work is done (the cache's decision,
`cache.policy.decide`, and the experts, `offload.sources.run_experts`), traced from a real
generation.  docs/architecture.md ("One token's way") lists them; this test holds the
list to the code and to issue 62's bound of six modules."""

import inspect
import re
from pathlib import Path

import jax
import pytest

import moejax
from moejax.cache import policy as policy_lib
from moejax.offload import decode as decode_lib
from moejax.offload import sources

ROOT = Path(__file__).resolve().parents[1]


def _documented() -> list[str]:
  """The modules docs/architecture.md lists under "One token's way", in order."""
  text = (ROOT / "docs" / "architecture.md").read_text()
  section = text.split("## One token's way", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"^\d+\. `(moejax[\w.]*)`", section, flags=re.M)


def _stack_modules() -> list[str]:
  """The moejax modules on the caller's stack, outermost first, repeats kept in order."""
  mods = []
  for frame in reversed(inspect.stack()[2:]):
    name = frame.frame.f_globals.get("__name__", "")
    if name.startswith("moejax") and (not mods or mods[-1] != name):
      mods.append(name)
  return mods


@pytest.fixture(scope="module")
def demo():
  return moejax.load(str(ROOT / "ckpts" / "demo"))


def test_a_tokens_way_passes_through_the_documented_six_modules(demo, monkeypatch):
  """Traced fresh (no compiled program reused): every stack that reaches the decision or
  the experts from `moejax.generate` holds only the documented modules, at most six,
  entered from the API, and together they are the list.  The native link's on-device
  loop (`decode.loop` -> `sampler.sample_loop` -> the step) is the longest way; a step
  dispatched at a time (`sampler.token_loop` -> `engine.decode_step` -> the step) passes
  the same modules."""
  stacks = []

  def spy(fn):
    def wrapped(*args, **kw):
      stacks.append((fn.__name__, _stack_modules()))
      return fn(*args, **kw)
    return wrapped

  monkeypatch.setattr(policy_lib, "decide", spy(policy_lib.decide))
  monkeypatch.setattr(decode_lib, "run_experts", spy(sources.run_experts))
  jax.clear_caches()
  decode_lib.step_fn.cache_clear()
  with moejax.OffloadEngine.from_model(demo, "quality", cache_fraction=0.25,
                                       link="native") as engine:
    moejax.generate(engine, "def f(n):", max_new_tokens=3)
  ways = [(leaf, mods) for leaf, mods in stacks
          if mods and mods[0] == "moejax.api" and "moejax.offload.decode" in mods]
  assert {leaf for leaf, _ in ways} == {"decide", "run_experts"}, stacks
  documented = _documented()
  assert len(documented) <= 6, documented
  for leaf, mods in ways:
    assert set(mods) <= set(documented), (leaf, mods)
  through = {m for _, mods in ways for m in mods}
  assert through == set(documented), (through, documented)
