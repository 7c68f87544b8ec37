# The set-up scripts' time estimates, in one place (env.sh, demo.sh and test.sh print these;
# nothing else states them).  Measured on the reference machine: 2 CPU cores, Python 3.11,
# pip from the local wheel cache.  Re-measure when the work changes, and edit here:
#   rm -rf .venv && time bash launch/demo.sh      (the install line + the demo)
#   time bash launch/demo.sh                      (a warm .venv: the demo alone)
#   time bash launch/test.sh                      (the whole suite, MOEJAX_TEST_JOBS=2)
# Last measured 2026-12-04: install with [test] 56 s (.venv's own timestamps); the demo
# about 30 s on an idle machine (172 s while other jobs held the load average at ~9.7);
# the suite about 20 minutes.  2026-12-07: the suite 28 minutes from a fresh clone (936 tests,
# 3,054 s of test processes two at a time; CI: 1,443 s with the install a stop before).
# Stop 65, the tests at XLA -O0 (test.sh): 18m10s from a fresh clone with the install (960 tests).
MOEJAX_TIME_INSTALL="about 1 minute"           # a fresh .venv: moejax and its [plot] extra
MOEJAX_TIME_INSTALL_TEST="about 1 minute"      # a fresh .venv: the [test] extras, torch CPU too
MOEJAX_TIME_DEMO="about 30 s"                  # launch.demo on 2 CPU cores, compilation included
MOEJAX_TIME_TESTS="about 20 minutes"           # the test suite on 2 CPU cores
