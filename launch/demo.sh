#!/usr/bin/env bash
# The main command: set-up (first run only), then the offload presets side by side on the
# shipped demo model (python -m launch.demo).  Extra arguments go to launch.demo.
MOEJAX_EXTRAS=plot    # matplotlib, for demo.png
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "[demo] python -m launch.demo: loads ckpts/demo, compiles one offload engine per preset," \
     "decodes and evaluates them ($MOEJAX_TIME_DEMO on 2 CPU cores)" >&2
exec python -m launch.demo "$@"
