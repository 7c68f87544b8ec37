"""moejax: Mixture-of-Experts inference with offloaded experts, in JAX/Flax.

  import moejax
  model = moejax.load("ckpts/demo")             # weights, host experts, tokenizer
  with moejax.OffloadEngine.from_model(model, "quality", cache_fraction=0.25) as engine:
    print(moejax.generate(engine, "def fibonacci(n):", max_new_tokens=32))

The API names (moejax/api.py) load on first use (PEP 562), so `import moejax` and
`import moejax.cli.X` import no JAX and no engine.
"""

# First, before anything imports jax: Ctrl-C during start-up (moejax/interrupts.py).
from moejax import interrupts as _interrupts
_interrupts.install()

_API = ("Model", "OffloadEngine", "generate", "load")
__all__ = list(_API)


def __getattr__(name: str):
  if name in _API:
    from moejax import api
    value = globals()[name] = getattr(api, name)
    return value
  raise AttributeError(f"module 'moejax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_API))
