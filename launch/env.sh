# Sourced by launch/demo.sh and launch/test.sh: create/refresh the venv in .venv and install moejax.
# Usage: source launch/env.sh [extras]   (extras e.g. "test")
set -e
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
STAMP=".venv/.moejax-installed-${1:-base}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  if [ -n "${1:-}" ]; then
    # torch first, pinned: 2.13.0 is the CPU wheel on this machine's disk
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[$1]"
  else
    python -m pip install -q -e .
  fi
  touch "$STAMP"
fi
export TOKENIZERS_PARALLELISM=false
