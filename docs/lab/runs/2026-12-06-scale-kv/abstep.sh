#!/bin/bash
# The batched decode step alone (batch_step_probe.py), old and new code alternating
# (OLD/NEW_WORKTREE, OLD/NEW_PYTHON as in ab.sh).
probe="$(cd "$(dirname "$0")" && pwd)/batch_step_probe.py"
for i in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then d=$OLD_WORKTREE; py=$OLD_PYTHON; else d=$NEW_WORKTREE; py=$NEW_PYTHON; fi
    cd "$d" && PYTHONPATH="$d" BS=${BS:-1,8} "$py" "$probe" ${POL:-quality} ${FRAC:-0.25} 2>&1 \
      | grep step | sed "s/^/[$v $i] /"
  done
done
