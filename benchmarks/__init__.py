"""The benchmarks: the logic of the `python -m launch.bench_*` commands (and of the other
measurement commands, launch.evaluate, predictors, estimator_inputs, compare_eviction),
writing JSON, and the demo model's training recipe (`launch.train_demo`).  Checkout-only:
not in the wheel; moejax never imports it (tests may)."""
