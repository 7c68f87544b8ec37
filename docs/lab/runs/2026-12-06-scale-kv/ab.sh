#!/bin/bash
# bench_serve's load test, old and new code alternating (OLD/NEW_WORKTREE: checkouts;
# OLD/NEW_PYTHON: an interpreter whose moejax is that checkout).
out="$(cd "$(dirname "$0")" && pwd)/ab"
for i in 1 2 3 4 5; do
  for v in old new; do
    if [ $v = old ]; then d=$OLD_WORKTREE; py=$OLD_PYTHON; else d=$NEW_WORKTREE; py=$NEW_PYTHON; fi
    cd "$d" && PYTHONPATH="$d" "$py" -m launch.bench_serve --clients=8 --requests=20 \
      --policy=quality --max_batches=1,8 --rounds=1 --server_args=--link=native \
      --out="$out/ab_${v}_$i.json" 2>&1 | tail -3 | sed "s/^/[$v $i] /"
  done
done
