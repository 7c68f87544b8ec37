#!/usr/bin/env bash
# Install (venv + pip, test extras) and run the test suite.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
exec python -m pytest tests "$@"
