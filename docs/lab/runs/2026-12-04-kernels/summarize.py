"""Summarises docs/lab/runs/2026-12-04-kernels/{before,after}_N.json: decode tok/s per run,
the best round of all runs per tree, and after/before ratios."""
import glob, json, os, statistics, sys

d = sys.argv[1] if len(sys.argv) > 1 else "docs/lab/runs/2026-12-04-kernels"
runs = {"before": [], "after": []}
for p in sorted(glob.glob(os.path.join(d, "*_[0-9].json"))):
  tree = os.path.basename(p).split("_")[0]
  runs[tree].append((os.path.basename(p), json.load(open(p))))
out = {"runs": {}, "summary": {}}
for tree, rs in runs.items():
  for name, r in rs:
    out["runs"][name] = {"load": [r["loadavg_start"][0], r["loadavg_end"][0]], **{
        f"{m}/{e}": round(v["decode_tok_s"], 1) for m, mm in r["models"].items()
        for e, v in mm["engines"].items()}}
for m in ("demo_f32", "demo_bf16"):
  for e in ("sampler", "engine"):
    row = {}
    for tree, rs in runs.items():
      rounds = [x for _, r in rs for x in r["models"][m]["engines"][e]["decode_rounds"]]
      row[tree] = {"best": round(max(rounds), 1), "median": round(statistics.median(rounds), 1),
                   "rounds": len(rounds)}
    row["after_over_before_best"] = round(row["after"]["best"] / row["before"]["best"], 3)
    row["after_over_before_median"] = round(row["after"]["median"] / row["before"]["median"], 3)
    out["summary"][f"{m}/{e}"] = row
print(json.dumps(out, indent=1))
