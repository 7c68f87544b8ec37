"""Training speculative prefetch's next-layer router-logit estimators.

  data    training pairs recorded from teacher-forced runs over the corpora
  train   training one estimator per MoE-layer pair with Optax

The estimator itself (a pure Flax module, `estimate`) is what the engine runs, so it lives
with the decode step that runs it: `moejax.prefetch.estimator`.
`moejax-train-estimators` (moejax/cli/prepare/train_estimators.py) runs data and train
on a model; the engine needs neither.
"""
