#!/bin/bash
# bench_peers (sampler, engine; demo f32/bf16; 3 rounds) from two checkouts, alternately:
#   BEFORE=<checkout> AFTER=<checkout> bash run.sh <label>...   labels: before_N / after_N
# JSON into docs/lab/runs/2026-12-04-kernels/<label>.json (docs/lab/notes/cpu_speed.md, "One switch").
OUT=${OUT:-docs/lab/runs/2026-12-04-kernels}
PY=${PY:-/work/main/.venv/bin/python}
ARGS="--engines=sampler,engine --models=demo_f32,demo_bf16 --rounds=3 --demo_dir=/work/main/ckpts/demo"
for spec in "$@"; do
  dir=$AFTER; [ "${spec%_*}" = before ] && dir=$BEFORE
  echo "== $spec $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd "$dir" && $PY -m launch.bench_peers $ARGS --out="$OUT/$spec.json") 2>&1 |
    grep -E "^demo_|wrote|load average" | grep -v rounds
done
