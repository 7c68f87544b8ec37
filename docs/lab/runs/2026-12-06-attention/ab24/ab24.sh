source /work/main/launch/env.sh
for i in 1 2; do
  cd /tmp/wt_old && PYTHONPATH=/tmp/wt_old python -m launch.bench_scale --layers=24 --memory_limit_gb=12 --rounds=1 --contenders=quality --out=/tmp/s55/ab24_old_$i.json 2>&1 | grep "quality:"
  cd /work/main && python -m launch.bench_scale --layers=24 --memory_limit_gb=12 --rounds=1 --contenders=quality --out=/tmp/s55/ab24_new_$i.json 2>&1 | grep "quality:"
done
