"""The study's generation experiment lives in moejax.cli.study_gen."""
import sys

from moejax.cli import study_gen as _impl

sys.modules[__name__] = _impl   # `from launch import study_gen` is moejax.cli.study_gen itself
