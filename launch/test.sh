#!/usr/bin/env bash
# Set-up with the test extras (first run only), then the test suite.  Extra arguments go to
# pytest, e.g. `bash launch/test.sh tests/test_policy.py -q`.
#
# Without arguments every test file runs in its own pytest process: one process compiling
# the whole suite's XLA programs was seen to crash inside XLA's CPU compiler (a segfault in
# backend_compile) after ~200 tests, while each file alone passed.  MOEJAX_TEST_JOBS files
# run at a time (default 2: the tests mostly compile, one core each); the slowest files
# start first.  Each file's output is printed when it ends; the last line is the total,
# "N passed, N failed[, N skipped]"; the exit status is non-zero if any file failed or ran
# no test.
MOEJAX_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
JOBS="${MOEJAX_TEST_JOBS:-2}"
# The tests mostly compile: XLA's CPU back-end at LLVM -O0 compiles them in ~0.6x the time
# (docs/lab/notes/cpu_speed.md, "Test time").  A test that wants two programs' bits equal
# compiles both alike (both jitted: an eager op is a program of its own, and at -O0 it may
# round one ulp apart).  Timed runs (launch/bench_*) keep XLA's default.
# MOEJAX_TEST_XLA_O0=0 turns it off.
if [ "${MOEJAX_TEST_XLA_O0:-1}" != 0 ]; then
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
fi
if [ "$#" -gt 0 ]; then   # what was asked for, in one process: the suite's banner does not fit
  echo "[test] python -m pytest $*" >&2
  exec python -m pytest "$@"
fi
echo "[test] python -m pytest tests, one process per file, $JOBS at a time: parity with" \
     "transformers, engine invariants, policy rules, command lines ($MOEJAX_TIME_TESTS on 2" \
     "CPU cores)" >&2
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
# One XLA compilation cache for this run's processes (removed with the logs): test files
# that build the same engine steps compile them once (docs/lab/notes/cpu_speed.md, "Test time").
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$logs/xla-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.3}"
run_one() {   # file, log dir: never fails (the status goes to <log>.rc)
  local log="$2/$(basename "$1").log" t0=$SECONDS
  python -m pytest "$1" -q -p no:cacheprovider -rfE >"$log" 2>&1 && echo 0 >"$log.rc" \
    || echo "$?" >"$log.rc"
  { echo "== $1 ($((SECONDS - t0)) s)"; cat "$log"; } | cat
}
export -f run_one
SLOW="tests/test_emulator.py tests/test_engine_programs.py tests/test_simulator.py tests/test_generate_cli.py
tests/test_expert_parallel.py tests/test_packaging.py tests/test_prefetch.py tests/test_engine_scan.py
tests/test_disk_tier.py tests/test_engine_batch.py tests/test_bench_gguf.py tests/test_bench_routing.py
tests/test_serve_start.py tests/test_frontier.py tests/test_demo_cli.py tests/test_batch_step.py"
files=()
for f in $SLOW; do [ -f "$f" ] && files+=("$f"); done   # a slow file that no longer exists
for f in tests/test_*.py; do
  case " $(echo $SLOW) " in *" $f "*) ;; *) files+=("$f") ;; esac
done
printf '%s\n' "${files[@]}" | xargs -P "$JOBS" -I{} bash -c 'run_one "$1" "$2"' _ {} "$logs"
passed=0; failed=0; skipped=0; status=0; bad=()
for f in "${files[@]}"; do
  out="$logs/$(basename "$f").log"
  rc="$(cat "$out.rc" 2>/dev/null || echo 1)"
  count() { grep -Eo "[0-9]+ $1" "$out" | tail -1 | grep -Eo "^[0-9]+" || echo 0; }
  p="$(count passed)"; fl="$(count failed)"; er="$(count error)"; sk="$(count skipped)"
  passed=$((passed + p)); failed=$((failed + fl + er)); skipped=$((skipped + sk))
  if [ "$rc" -ne 0 ]; then
    status=1; bad+=("$f (exit $rc)")
    [ "$((fl + er))" -eq 0 ] && failed=$((failed + 1))   # crashed or ran no test
  fi
done
[ "${#bad[@]}" -gt 0 ] && printf 'failed: %s\n' "${bad[@]}"
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
