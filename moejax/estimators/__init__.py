"""Speculative prefetch's next-layer router-logit estimators.

  model   the estimator as a pure Flax module (`estimate`): what the engine runs
  data    training pairs recorded from teacher-forced runs over the corpora
  train   training one estimator per MoE-layer pair with Optax

`moejax-train-estimators` (moejax/cli/prepare/train_estimators.py) runs data and train
on a model; the engine needs only `model`.
"""
