# First, before anything imports jax: Ctrl-C during start-up (moejax/interrupts.py).
from moejax import interrupts as _interrupts
_interrupts.install()
