"""The exit-code and Ctrl-C plumbing, for the launch scripts that still import it from here
(default_vectors, train_estimators, bench_host, bench_expert_parallel); it lives in
moejax.cli.app, which new scripts import."""
from moejax.cli.app import UsageError, demo_model_dir, run, usage_exit  # noqa: F401
