# Sourced by launch/demo.sh and launch/test.sh: create/refresh the venv in .venv and install moejax.
# Usage: MOEJAX_EXTRAS=test; source launch/env.sh   (extras optional; the caller's own
# arguments are not read, so they can be passed on to the command it runs)
set -e
EXTRAS="${MOEJAX_EXTRAS:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
STAMP=".venv/.moejax-installed-${EXTRAS:-base}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  if [ -n "$EXTRAS" ]; then
    # torch first, pinned: 2.13.0 is the CPU wheel on this machine's disk
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[$EXTRAS]"
  else
    python -m pip install -q -e .
  fi
  touch "$STAMP"
fi
export TOKENIZERS_PARALLELISM=false
