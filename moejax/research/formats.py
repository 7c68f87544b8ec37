"""The weight format as a knob under a memory budget (issue 61, part 5).

A device memory budget for the expert cache (bytes over all MoE layers, as --cache_bytes)
holds more experts the fewer bytes one takes: 16 bf16 experts of the demo model's 64 a
layer fit where 30 Q8_0 or 56 Q4_0 ones do.  `table` scores, for each format of
`formats`, the largest cache the budget holds (`candidates`: slots from
`resident.make_budget`, bytes per expert from the format's blocks, `quantized.expert_nbytes`)
under each policy of `policies`:

  quality  the emulator's perplexity of the format's model under the policy at that
           fraction, against the float model's (the float store under fetch_all, which is
           exact: the all-resident model's), on the calibration streams `--policy=auto`
           uses (`streams.calibration_documents`);
  speed    the simulator's replay of the format's own routing (its router logits on the
           same streams) under the policy at that fraction, timed by the roofline time
           model of the model shape with every byte scaled by the format's bytes per
           value against bf16 (`shape_for`): PROJECTED, not measured.

and picks one with `autotune.choose` (the fastest within a perplexity budget, or the
least increase within a time budget): `Choice`.  The float format counts its experts in
the run's dtype (bf16 by default); its projection is the shape's own (bf16).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import jax.numpy as jnp

from moejax.cache import policy as policy_lib
from moejax.cache import resident
from moejax.io.weights import quantized
from moejax.offload import hardware, memory
from moejax.research import autotune as A
from moejax.research import frontier as F
from moejax.research.study import metrics as M
from moejax.research.study import runner as R
from moejax.research.study import streams as S

FORMATS = ("float", "q8_0", "q4_0")
POLICIES = ("fetch_all", "quality")


@dataclasses.dataclass(frozen=True)
class Candidate:
  weights: str          # "float" or a block format
  expert_bytes: int     # one routed expert as the store holds it
  slots: int            # experts a layer the budget holds (at most E)
  fraction: float       # slots / E


def expert_bytes(cfg, weights: str, dtype="bfloat16") -> int:
  return (quantized.expert_nbytes(cfg, weights) if weights != "float" else
          memory.expert_nbytes(cfg, jnp.dtype(dtype)))


def candidates(cfg, budget_bytes: int, formats=FORMATS, dtype="bfloat16") -> list[Candidate]:
  """Per format the largest expert cache `budget_bytes` holds; a format that cannot hold
  one slot a layer is left out (AutoTuneError when none can)."""
  out, n_moe, need = [], len(cfg.moe_layers), {}
  for w in formats:
    quantized.check_weights(w, "--formats")
    eb = expert_bytes(cfg, w, dtype)
    try:
      b = resident.make_budget(cfg.num_experts, cfg.top_k, eb, n_moe, nbytes=budget_bytes)
    except resident.BudgetError:
      need[w] = eb * n_moe
      continue
    slots = min(b.slots, cfg.num_experts)
    out.append(Candidate(w, eb, slots, slots / cfg.num_experts))
  if not out:
    w = min(need, key=need.get)
    raise A.AutoTuneError(f"--cache_bytes={budget_bytes}: no format of {', '.join(formats)} "
                          f"holds one expert a layer; {w} needs {need[w]} bytes "
                          f"(nearest feasible: --cache_bytes={need[w]})")
  return out


def shape_for(shape: hardware.ModelShape, ratio: float, weights: str) -> hardware.ModelShape:
  """`shape` (bf16 bytes) with every byte it reads scaled by `ratio` (the format's bytes per
  value over bf16's; norms and routers, which keep their precision, are counted at the
  ratio too: a small overcount of the saving)."""
  if weights == "float":
    return shape
  return dataclasses.replace(shape, name=f"{shape.name} in {weights}",
                             expert_bytes=int(round(shape.expert_bytes * ratio)),
                             layer_bytes=int(round(shape.layer_bytes * ratio)),
                             head_bytes=int(round(shape.head_bytes * ratio)))


@dataclasses.dataclass
class Choice:
  row: dict             # the chosen row of `table`
  reason: str


def _rows(cfg, params, store, cand: Candidate, st, base, c: F.Config, out_dir, dtype,
          shape, profile, policies, bf16_bytes, tag) -> list[dict]:
  """The rows of one candidate: per policy, the emulator's dPPL against `base` (the float
  model's run) and the simulator's projected ms a token in the format's bytes."""
  pols = [policy_lib.make_policy(p) for p in policies]
  ratio = cand.expert_bytes / bf16_bytes
  times = A.time_params([profile], shape_for(shape, ratio, cand.weights))
  pts = A.sweep(cfg, F.stream_logits(cfg, params, store, st, dtype=dtype), pols, times=times,
                shape_layers=shape.moe_layers, expert_bytes=cand.expert_bytes,
                cache_fraction=cand.fraction)
  runner = R.Runner(cfg, params, store, st, f"{out_dir}/{cand.weights}", max_len=c.window,
                    chunk=min(c.chunk, c.window), dtype=dtype)
  rows = []
  for name, p, pt in zip(policies, pols, pts):
    run = runner.run(f"{F.run_key(p)}_f{cand.fraction:g}{tag}", p,
                     cache_fraction=cand.fraction)
    m = M.metrics(run, base, c.bootstrap)
    rows.append(dict(weights=cand.weights, expert_bytes=cand.expert_bytes, slots=cand.slots,
                     cache_fraction=cand.fraction, policy=name, ppl=m["ppl"],
                     ppl_increase_pct=m["ppl_increase_pct"],
                     ppl_increase_ci=list(m["ppl_increase_ci"]),
                     fetches_per_token=m["fetches_per_token"],
                     projected_ms_per_token=pt.ms[profile]))
  return rows


def table(load, tok, budget_bytes: int, budget: A.Budget, out_dir: str, *,
          formats=FORMATS, policies=POLICIES, c: F.Config = F.AUTO, dtype="bfloat16",
          profile: str | None = None, shape=None, docs=None, log=print) -> dict:
  """The formats' table under `budget_bytes` and the `Choice` for `budget` (a JSON-ready
  dict).  load(weights) -> (cfg, params, store) of the model in that format and `dtype`;
  shape: the projection's model shape (default: the model's own, `frontier.own_shape`);
  profile: the hardware profile (default: the budget's, else frontier's RTX 3090)."""
  t0 = time.time()
  dtype = jnp.dtype(dtype)
  profile = profile or budget.profile or F.SPEEDUP_PROFILE
  cfg, params, store = load("float")
  cands = candidates(cfg, budget_bytes, formats, dtype)
  shape = shape or F.own_shape(cfg)
  st = F.make_streams(S.calibration_documents(tok) if docs is None else docs, c)
  tag = "_s" + hashlib.sha1(st.tokens.tobytes() + st.pos.tobytes()).hexdigest()[:8]
  log(f"[formats] {budget_bytes} bytes of expert cache: " + ", ".join(
      f"{k.weights} {k.slots}/{cfg.num_experts} ({k.fraction:.0%})" for k in cands)
      + f"; {st.tokens.shape[0]} streams x {st.tokens.shape[1]} tokens")
  fetch_all = policy_lib.make_policy("fetch_all")
  base = R.Runner(cfg, params, store, st, f"{out_dir}/float", max_len=c.window,
                  chunk=min(c.chunk, c.window), dtype=dtype).run(
                      f"fetch_all_f1{tag}", fetch_all, cache_fraction=1.0)
  bf16 = expert_bytes(cfg, "float", jnp.bfloat16)
  rows = []
  for k in cands:
    if k.weights != "float":
      cfg, params, store = load(k.weights)
    rows += _rows(cfg, params, store, k, st, base, c, out_dir, dtype, shape, profile,
                  policies, bf16, tag)
    log(f"[formats] {k.weights} at {k.fraction:.0%}: " + ", ".join(
        f"{r['policy']} {r['ppl_increase_pct']:+.2f}% {r['projected_ms_per_token']:.3g} ms"
        for r in rows[-len(policies):]) + f" ({time.time() - t0:.0f} s)")
  choice = choose(rows, budget)
  return dict(budget_bytes=budget_bytes, budget=dataclasses.asdict(budget), profile=profile,
              shape=shape.name, dtype=dtype.name, rows=rows,
              choice=dict(choice.row, reason=choice.reason),
              streams=[int(x) for x in st.tokens.shape], documents=st.num_docs,
              note="ppl_increase_pct: the emulator's, against the float model (exact); "
                   "projected_ms_per_token: the simulator's counts timed by the roofline "
                   f"model of {shape.name} on {profile}, its bytes scaled to each format "
                   "(PROJECTED, not measured)", seconds=time.time() - t0)


def choose(rows: list[dict], budget: A.Budget) -> Choice:
  """The row `autotune.choose` picks for `budget` (AutoTuneError when none meets it)."""
  labels = [f"{r['weights']} at {r['cache_fraction']:.0%} under {r['policy']}" for r in rows]
  i = A.choose([r["ppl_increase_pct"] for r in rows],
               [r["projected_ms_per_token"] for r in rows], budget, labels=labels)
  how = ("the fastest projected within" if budget.ppl_pct is not None else
         "the least perplexity increase within")
  return Choice(rows[i], f"{labels[i]}: {how} {budget.describe()}")


def format_table(res: dict) -> str:
  """The table as Markdown (docs/policies.md's)."""
  head = ("| weights | bytes / expert | resident | policy | ppl | dPPL vs float % (95% CI) "
          f"| projected ms / token ({res['profile']}) |\n| --- | ---: | ---: | --- | ---: | --- "
          "| ---: |")
  lines = [head]
  for r in res["rows"]:
    lo, hi = r["ppl_increase_ci"]
    mark = "**" if (r["weights"], r["cache_fraction"], r["policy"]) == (
        res["choice"]["weights"], res["choice"]["cache_fraction"], res["choice"]["policy"]) \
        else ""
    lines.append(f"| {mark}{r['weights']}{mark} | {r['expert_bytes']:,} | "
                 f"{r['slots']} ({r['cache_fraction']:.0%}) | {r['policy']} | {r['ppl']:.3f} | "
                 f"{r['ppl_increase_pct']:+.2f} [{lo:+.2f}, {hi:+.2f}] | "
                 f"{r['projected_ms_per_token']:.3g} |")
  return "\n".join(lines)
