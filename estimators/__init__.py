"""The estimators' checkout alias: `from estimators import model` and `import
estimators.train` give moejax.estimators' modules (installed with moejax, where this
folder is not: see README.md here)."""
import importlib
import sys

for _name in ("model", "data", "train"):
  globals()[_name] = sys.modules[f"{__name__}.{_name}"] = importlib.import_module(
      f"moejax.estimators.{_name}")
