"""The time of each leaf HLO op (loops, conds and calls left out) in the newest
jax.profiler trace under a folder: decode_profile.py and engine_profile.py read it."""
import collections
import glob
import gzip
import json
import re


def leaf_ops(trace_dir: str):
  """-> (total us by op name, calls by op name) over the trace's complete events."""
  f = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
  tot, cnt = collections.Counter(), collections.Counter()
  for e in json.load(gzip.open(f))["traceEvents"]:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    op = (e.get("args") or {}).get("hlo_op")
    if not op or re.match(r"(while|cond|call|conditional)(\.\d+)?$", op):
      continue
    k = re.sub(r"\.\d+$", "", op)
    tot[k] += e["dur"]
    cnt[k] += 1
  return tot, cnt
