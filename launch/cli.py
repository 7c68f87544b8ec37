"""The launch scripts' exit-code and Ctrl-C plumbing lives in moejax.cli.app."""
import sys

from moejax.cli import app as _impl

sys.modules[__name__] = _impl   # `from launch import cli` is moejax.cli.app itself
