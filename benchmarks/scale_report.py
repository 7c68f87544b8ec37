"""bench_scale's report (benchmarks/scale.py): the medians over rounds per contender, the
ratios to llama.cpp, and the terminal table."""

from __future__ import annotations

import statistics

GB = 1e9


def median(rows: list[dict], key: str):
  vals = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(vals) if vals else None


def summarize(runs: dict) -> dict:
  keys = ("decode_tok_s", "prefill_tok_s", "decode_read_bytes_per_token", "peak_anon_bytes",
          "group_peak_bytes", "wall_s", "load_s", "engine_s", "compile_s", "hit_rate",
          "fetches_per_token", "substituted_call_pct", "misses_per_token")
  out = {}
  for name, rows in runs.items():
    s = {k: median(rows, k) for k in keys}
    seen = [r["routing"] for r in rows if r.get("routing")]
    if seen:              # the stream's routing: the same in every round
      s["stream_routing"] = seen[0].get("stream")
    s["oom_killed"] = [r["oom_killed"] for r in rows]
    s["failed"] = sum(1 for r in rows if "error" in r)
    out[name] = s
  ref = out.get("llama.cpp", {}).get("decode_tok_s")
  for name, s in out.items():
    s["x_llama_cpp"] = s["decode_tok_s"] / ref if ref and s["decode_tok_s"] else None
  return out


def table(res: dict) -> str:
  def f(v, scale=1.0, fmt="{:.2f}"):
    return "n/a" if v is None else fmt.format(v / scale)
  plan = res["plan"]
  lines = [f"{res['layers']} layers in {res.get('weights', 'bf16')} "
           f"({res['model_bytes'] / GB:.1f} GB) in a "
           f"{res['memory_limit_gb']:g} GB cgroup; moejax plan anon "
           f"{plan['anon_bytes'] / GB:.2f} GB (+1 GB runtime); medians of {res['rounds']} rounds",
           f"{'contender':<11}{'decode t/s':>11}{'prefill t/s':>12}{'MB/token':>10}"
           f"{'anon GB':>9}{'group GB':>9}{'OOM':>5}{'x llama':>9}{'hit %':>7}{'fetch/t':>8}"]
  for name, s in res["summary"].items():
    lines.append(f"{name:<11}{f(s['decode_tok_s']):>11}{f(s['prefill_tok_s']):>12}"
                 f"{f(s['decode_read_bytes_per_token'], 1e6, '{:.0f}'):>10}"
                 f"{f(s['peak_anon_bytes'], GB):>9}{f(s['group_peak_bytes'], GB):>9}"
                 f"{'yes' if any(s['oom_killed']) else 'no':>5}{f(s['x_llama_cpp']):>9}"
                 f"{f(s['hit_rate'], 0.01, '{:.1f}'):>7}{f(s['fetches_per_token'], 1, '{:.1f}'):>8}")
  seen = next((v["stream_routing"] for v in res["summary"].values()
               if v.get("stream_routing")), None)
  if seen:
    lines.append(f"the stream's routing: an LRU of 25% hits {seen['lru_hit_mean']:.3f} "
                 f"(shuffled {seen['lru_hit_shuffled_mean']:.3f}); the 8 busiest experts take "
                 f"up to {seen['busiest8_share_max']:.1%} of a layer's calls")
  lines.append(f"load average: start {res['loadavg_start']}, end {res['loadavg_end']}")
  return "\n".join(lines)
