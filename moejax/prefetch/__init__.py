"""Speculative expert prefetch: quasi-hidden states, default vectors, estimator files and the in-program prediction steps."""
