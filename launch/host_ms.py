"""`python -m launch.host_ms` from a checkout; the program is moejax.cli.prepare.host_ms,
which an installed moejax runs as `moejax-host-ms` (launch/bench_host.py: the same
timing beside llama.cpp's)."""
import sys

from moejax.cli.prepare import host_ms as _impl

if __name__ == "__main__":
  _impl.entry()
else:
  sys.modules[__name__] = _impl   # `from launch import host_ms`: the program itself
