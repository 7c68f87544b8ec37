# Sourced by launch/demo.sh and launch/test.sh: creates .venv (first run only) and installs
# moejax into it.  pip's own output goes to .venv/pip-install.log and is shown only if pip fails.
# Usage: MOEJAX_EXTRAS=test; source launch/env.sh   (extras optional, comma-separated:
# plot for the demo's PNG, test for the suite; the caller's own arguments are not read, so
# they can be passed on to the command it runs).  Time estimates come from launch/times.sh.
set -e
EXTRAS="${MOEJAX_EXTRAS:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. launch/times.sh
PY="${PYTHON:-python3}"
say() { echo "[setup] $*" >&2; }

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  say "error: moejax needs Python 3.11 or newer (jax 0.10 does); '$PY' is" \
      "$("$PY" --version 2>&1 || echo 'not found'). Point PYTHON at one, e.g. PYTHON=python3.12"
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
. .venv/bin/activate

STAMP=".venv/.moejax-installed-${EXTRAS:-base}"
LOG=".venv/pip-install.log"
pip_quiet() {
  if ! python -m pip "$@" >>"$LOG" 2>&1; then
    say "error: 'pip $*' failed; the end of its log ($ROOT/$LOG):"
    tail -n 60 "$LOG" >&2
    exit 1
  fi
}
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  case ",$EXTRAS," in
    *,test,*)
      testing=1
      say "installing moejax with its [$EXTRAS] extras (jax, flax, torch CPU, transformers ...)" \
          "into .venv: $MOEJAX_TIME_INSTALL_TEST the first time, skipped afterwards; log: $LOG" ;;
    *)
      testing=
      say "installing moejax${EXTRAS:+ with its [$EXTRAS] extras} (jax, flax, optax ...) into" \
          ".venv: $MOEJAX_TIME_INSTALL the first time, skipped afterwards; log: $LOG" ;;
  esac
  start=$SECONDS
  : >"$LOG"
  pip_quiet install --upgrade pip
  if [ -n "$testing" ]; then
    # torch first, pinned: 2.13.0 is the CPU wheel the tests compare against
    pip_quiet install "torch==2.13.0"
  fi
  pip_quiet install -e ".${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
  say "installed in $((SECONDS - start)) s"
fi
export TOKENIZERS_PARALLELISM=false
