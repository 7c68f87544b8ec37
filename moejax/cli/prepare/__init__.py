"""The programs that prepare a model's files for moejax-generate's flags:

  moejax-default-vectors    default_vectors.py    --prefetch=quasi (and hybrid)
  moejax-train-estimators   train_estimators.py   --prefetch=hybrid
  moejax-host-ms            host_ms.py            --policy=cost --host_ms=FILE
"""
