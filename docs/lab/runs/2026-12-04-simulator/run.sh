#!/bin/bash
# before (HEAD a2aa822, git archive in /tmp/sim/orig) and after (working tree), one run
set -x
A="--tokens=2048 --chunk=2048 --sweep=20 --repeats=2"
date -u; uptime
(cd /tmp/sim/orig && /work/main/.venv/bin/python -m launch.bench_simulator --out=/tmp/sim/bench/before.json $A) 2>&1 | grep bench_sim
date -u; uptime
(cd /work/main && .venv/bin/python -m launch.bench_simulator --out=/tmp/sim/bench/after.json $A) 2>&1 | grep bench_sim
date -u; uptime
(cd /work/main && XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python -m launch.bench_simulator --out=/tmp/sim/bench/after_1dev.json $A) 2>&1 | grep bench_sim
date -u; uptime
(cd /work/main && .venv/bin/python -m launch.bench_simulator --out=/tmp/sim/bench/after_traces4.json $A --traces=4) 2>&1 | grep bench_sim
date -u; uptime
