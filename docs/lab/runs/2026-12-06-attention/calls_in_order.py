# Each FFI call of a decode token in program order, median us over the 16 profiled tokens.
import glob,gzip,json,collections
f=sorted(glob.glob("/tmp/prof_wide/**/*.trace.json.gz",recursive=True))[-1]
ev=json.load(gzip.open(f))["traceEvents"]
xs=[e for e in ev if e.get("ph")=="X" and (e.get("args") or {}).get("hlo_op","").startswith("ffi_call")]
xs.sort(key=lambda e:e["ts"])
# print args keys of one
print(xs[0].get("args"))
n=len(xs)//16
tot=collections.defaultdict(list)
for i,e in enumerate(xs): tot[i%n].append(e["dur"])
import numpy as np
for i in range(n): print(i, xs[i]["args"].get("hlo_op"), "%.0f"%np.median(tot[i]))
# gaps
ev2=sorted([e for e in ev if e.get("ph")=="X" and (e.get("args") or {}).get("hlo_op")],key=lambda e:e["ts"])
