"""`python -m launch.host_ms` from a checkout; the program is moejax.cli.prepare.host_ms,
which an installed moejax runs as `moejax-host-ms` (launch.bench_host: the same timing
beside llama.cpp's)."""
from moejax.cli.prepare import host_ms

if __name__ == "__main__":
  host_ms.entry()
