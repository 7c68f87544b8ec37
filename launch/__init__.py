"""The checkout's scripts.  moejax first, before any of them imports jax: Ctrl-C while
jax and C extensions import is held until they are set up, and ends the script with one
line and exit 130 (moejax/interrupts.py)."""
import moejax  # noqa: F401  pylint: disable=unused-import
