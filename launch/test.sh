#!/usr/bin/env bash
# Install (venv + pip, test extras) and run the test suite.
MOEJAX_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest tests "$@"
