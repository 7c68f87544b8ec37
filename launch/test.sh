#!/usr/bin/env bash
# Set-up with the test extras (first run only), then the test suite.  Extra arguments go to
# pytest, e.g. `bash launch/test.sh tests/test_policy.py -q`.
#
# Without arguments every test file runs in its own pytest process: one process compiling
# the whole suite's XLA programs was seen to crash inside XLA's CPU compiler (a segfault in
# backend_compile) after ~200 tests, while each file alone passed.  The last line is the
# total, "N passed, N failed[, N skipped]"; the exit status is non-zero if any file failed
# or ran no test.
MOEJAX_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "[test] python -m pytest tests, one process per file: parity with transformers, engine" \
     "invariants, policy rules, command lines (about 20-25 minutes on 2 CPU cores)" >&2
if [ "$#" -gt 0 ]; then
  exec python -m pytest "$@"
fi
passed=0; failed=0; skipped=0; status=0; bad=()
for f in tests/test_*.py; do
  out="$(mktemp)"
  python -m pytest "$f" -q -p no:cacheprovider -rfE 2>&1 | tee "$out"
  rc="${PIPESTATUS[0]}"
  count() { grep -Eo "[0-9]+ $1" "$out" | tail -1 | grep -Eo "^[0-9]+" || echo 0; }
  p="$(count passed)"; fl="$(count failed)"; er="$(count error)"; sk="$(count skipped)"
  passed=$((passed + p)); failed=$((failed + fl + er)); skipped=$((skipped + sk))
  if [ "$rc" -ne 0 ]; then
    status=1; bad+=("$f (exit $rc)")
    [ "$((fl + er))" -eq 0 ] && failed=$((failed + 1))   # crashed or ran no test
  fi
  rm -f "$out"
done
[ "${#bad[@]}" -gt 0 ] && printf 'failed: %s\n' "${bad[@]}"
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
