#!/usr/bin/env bash
# Set-up with the test extras (first run only), then the test suite.  Extra arguments go to
# pytest, e.g. `bash launch/test.sh tests/test_policy.py -q`.
MOEJAX_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "[test] python -m pytest tests: parity with transformers, engine invariants, policy" \
     "rules, command lines (about 10-15 minutes on 2 CPU cores)" >&2
exec python -m pytest tests "$@"
