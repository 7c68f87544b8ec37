"""Training the demo model: the loss and Optax step, and the corpora it reads."""
