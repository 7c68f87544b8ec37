"""The estimators' checkout alias: `from estimators import model` and `import
estimators.train` give the estimator's modules (installed with moejax, where this
folder is not: see README.md here)."""
import importlib
import sys

_MODULES = {"model": "moejax.prefetch.estimator", "data": "moejax.estimators.data",
            "train": "moejax.estimators.train"}
for _name, _module in _MODULES.items():
  globals()[_name] = sys.modules[f"{__name__}.{_name}"] = importlib.import_module(_module)
