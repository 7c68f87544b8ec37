"""The measured quality/speed frontier of the miss policies, and auto-tuning on it.

On the quality study's streams (held-out stdlib + HumanEval documents), split in two
by document (even / odd: *calibration* and *held-out*):

  1. the calibration streams' router logits are recorded with every expert resident
     (windows aligned with the streams' attention windows), one trace per stream;
  2. the simulator replays them under a grid of policies (`autotune.sweep`): quality
     proxy, waited bytes and projected time per token for the target shape/profile;
  3. the emulator measures fetch_all, the thresholds and the presets on the
     calibration streams (exact perplexity); those are the proxy's anchors;
  4. per perplexity budget, `autotune.tune` picks a policy and checks it with the
     emulator;
  5. fetch_all and each choice are re-measured on the held-out streams (not used for
     tuning).

Emulations go through the study's `Runner` (cached under OUT/<split>/runs, so an
interrupted run resumes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time

import jax.numpy as jnp
import numpy as np

from moejax.cache import policy as policy_lib
from moejax.io import traces
from moejax.offload import hardware
from moejax.research import autotune as A
from moejax.research import quality_fit
from moejax.research.study import metrics as M
from moejax.research.study import runner as R
from moejax.research.study import streams as S

SPEEDUP_PROFILE = "rtx3090"     # projected_speedup_rtx3090 (Qwen3-30B-A3B shape)


@dataclasses.dataclass(frozen=True)
class Config:
  cache_fraction: float = 0.25
  streams: int = 16
  max_tokens: int = 4096          # per split, over all its streams
  window: int = 256
  max_doc_tokens: int = 512
  chunk: int = 256
  seed: int = 0
  taus: tuple = (0.03, 0.05, 0.1, 0.15, 0.3)     # measured thresholds (anchors)
  presets: tuple = ("quality", "speed")            # measured presets (baseline = fetch_all)
  ppl_budgets: tuple = (1.0,)
  tpot_budget_ms: float | None = None
  profile: str | None = None                       # the time budget's profile
  shape: object = hardware.DEFAULT_MODEL          # a name in hardware.MODELS or a ModelShape
  budgets: tuple = ()                              # autotune.Budget; () = from the fields above
  heldout: bool = True
  max_checks: int = 3
  bootstrap: int = 2000
  grid: tuple = ()                                 # PolicyParams; () = autotune.grid()


def split_documents(docs) -> tuple[list, list]:
  """(calibration, held-out): the even and the odd documents of the study's list."""
  return docs[0::2], docs[1::2]


def make_streams(docs, c: Config) -> S.Streams:
  return S.build(docs, c.streams, c.max_tokens, c.window, c.seed, c.max_doc_tokens,
                 round_to=min(c.chunk, c.window))


def stream_logits(cfg, params, store, st: S.Streams, batch: int = 8,
                  dtype=jnp.float32) -> list[np.ndarray]:
  """Per stream its router logits [T, L, R] with every expert resident, each attention
  window (position 0 restarts) a forward pass of its own, as the emulator's (in the
  model's compute `dtype`)."""
  b, t = st.tokens.shape
  w = int(st.pos.max()) + 1
  nw = -(-t // w)
  flat = np.zeros((b, nw * w), np.int32)
  flat[:, :t] = st.tokens
  lg, _ = traces.record_router_logits(cfg, params, store, flat.reshape(-1), seq=w,
                                      batch=batch, dtype=dtype)
  lg = lg.reshape(b, nw * w, *lg.shape[1:])[:, :t]
  return [lg[i] for i in range(b)]


def expert_bf16_bytes(cfg) -> int:
  """One routed expert's bytes in bf16 (what a waited fetch moves, however stored)."""
  return hardware.moe_layer_bytes(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, cfg.num_experts, cfg.top_k,
                                  cfg.moe_intermediate_size)[0]


def run_key(policy) -> str:
  return re.sub(r"[^A-Za-z0-9.]+", "_", A.label(policy)).strip("_")


class Measurer:
  """Emulates policies on one split's streams: perplexity against fetch_all's."""

  def __init__(self, cfg, params, store, st: S.Streams, out_dir: str, c: Config):
    self.c, self.st, self.cfg = c, st, cfg
    self.runner = R.Runner(cfg, params, store, st, out_dir, max_len=c.window,
                           chunk=min(c.chunk, c.window))
    self.tag = (f"_f{c.cache_fraction:g}_s"
                f"{hashlib.sha1(st.tokens.tobytes() + st.pos.tobytes()).hexdigest()[:8]}")
    self.ebytes = expert_bf16_bytes(cfg)
    self.base = self.runner.run("fetch_all" + self.tag, policy_lib.make_policy("fetch_all"),
                                cache_fraction=c.cache_fraction)

  def metrics(self, policy) -> dict:
    run = (self.base if A.key(policy) == A.key(policy_lib.make_policy("fetch_all")) else
           self.runner.run(run_key(policy) + self.tag, policy,
                           cache_fraction=self.c.cache_fraction))
    m = M.metrics(run, self.base, self.c.bootstrap)
    tot = dict(zip(M.STATS, run["totals"]))
    low = tot.get("fetches_low", 0.0) / max(run["tokens"], 1.0)
    m["fetches_low_per_token"] = low
    m["waited_bf16_bytes_per_token"] = (m["fetches_per_token"]
                                        + A.low_ratio(self.cfg, policy) * low) * self.ebytes
    return m

  def dppl(self, policy) -> float:
    return self.metrics(policy)["ppl_increase_pct"]


def _point(policy, m: dict, sw: A.Point, base_m: dict, base_sw: A.Point, heldout: bool,
           role: str, predicted: float | None) -> dict:
  ms = sw.ms[SPEEDUP_PROFILE]
  return dict(policy=A.label(policy), rule=policy.describe(), role=role, heldout=heldout,
              ppl=m["ppl"], ppl_increase_pct=m.get("ppl_increase_pct", 0.0),
              ppl_increase_ci=m.get("ppl_increase_ci", [0.0, 0.0]),
              predicted_ppl_increase_pct=predicted,
              waited_bf16_bytes_per_token=m["waited_bf16_bytes_per_token"],
              waited_bytes_ratio=m["waited_bf16_bytes_per_token"]
              / max(base_m["waited_bf16_bytes_per_token"], 1e-12),
              fetches_per_token=m["fetches_per_token"], hit_rate=m["hit_rate"],
              substituted_mass=m["substituted_mass"], sim_mass=sw.mass,
              projected_ms_per_token_rtx3090=ms,
              projected_speedup_rtx3090=base_sw.ms[SPEEDUP_PROFILE] / ms)


@dataclasses.dataclass
class _Run:
  """What the steps of `build` share: the model, the options, the time model's parameters
  and the log."""
  cfg: object
  params: object
  store: object
  c: Config
  out_dir: str
  log: object
  progress: object
  shape: hardware.ModelShape
  times: object
  t0: float = dataclasses.field(default_factory=time.time)

  def clock(self) -> str:
    return f"{time.time() - self.t0:.0f} s"

  def logits(self, st: S.Streams) -> list[np.ndarray]:
    return stream_logits(self.cfg, self.params, self.store, st)

  def measurer(self, st: S.Streams, split: str) -> Measurer:
    return Measurer(self.cfg, self.params, self.store, st, f"{self.out_dir}/{split}", self.c)

  def sweep(self, logits, pols, what: str) -> list:
    bar = self.progress(f"simulating {what}", len(logits)) if self.progress else None
    return A.sweep(self.cfg, logits, pols, times=self.times, shape_layers=self.shape.moe_layers,
                   expert_bytes=expert_bf16_bytes(self.cfg), cache_fraction=self.c.cache_fraction,
                   progress=bar)


@dataclasses.dataclass
class _Calibration:
  """The calibration split's sweep (`pts`, found by `A.key` through `index`) and the
  emulated metrics of the points measured so far ({index in pts: metrics})."""
  logits: list
  pts: list
  measured: dict
  meas: Measurer

  @property
  def index(self) -> dict:
    return {A.key(p.policy): i for i, p in enumerate(self.pts)}

  def fit(self):
    return quality_fit.fit_quality([self.pts[i].mass for i in self.measured],
                                   [m["ppl_increase_pct"] for m in self.measured.values()])


def build(cfg, params, store, tok, c: Config, out_dir: str, log=print,
          progress=None, docs=None) -> tuple[dict, list]:
  """The frontier (a JSON-ready dict: sweep, measured points, auto choices; see the module
  docstring) and the chosen PolicyParams, one per budget.  progress(desc, total) -> a
  callable advancing a bar (or None).  docs: the documents to split (default: the quality
  study's, `streams.documents`, which needs the humaneval extra)."""
  t0 = time.time()
  budgets = list(c.budgets) or [A.Budget(ppl_pct=b) for b in c.ppl_budgets]
  if c.tpot_budget_ms is not None and not c.budgets:
    budgets.append(A.Budget(tpot_ms=c.tpot_budget_ms, profile=c.profile))
  cal_docs, held_docs = split_documents(S.documents(tok) if docs is None else docs)
  shape = hardware.model_shape(c.shape) if isinstance(c.shape, str) else c.shape
  profiles = sorted({SPEEDUP_PROFILE} | {b.profile for b in budgets if b.profile})
  run = _Run(cfg, params, store, c, out_dir, log, progress, shape,
             A.time_params(profiles, shape), t0)
  measured_specs = ([policy_lib.make_policy("fetch_all")]
                    + [policy_lib.make_policy("threshold", tau=t) for t in c.taus]
                    + [policy_lib.make_policy(p) for p in c.presets])
  cal_st = make_streams(cal_docs, c)
  cal = _calibrate(run, cal_st, measured_specs)
  base_i = cal.index[A.key(measured_specs[0])]
  autos = [(b, _auto(run, cal, b)) for b in budgets]
  pts = cal.pts
  fit = cal.fit()
  pred = fit.predict([p.mass for p in pts])
  points = _calibration_points(cal, base_i, {ch.index for _, ch in autos}, pred)
  held = None
  if c.heldout:
    held = _heldout(run, make_streams(held_docs, c), cal, base_i, autos, pred, points)
  report = _report(run, cal_st, cal, base_i, autos, fit, pred, points, held)
  return report, [pts[ch.index].policy for _, ch in autos]


def _calibrate(run: _Run, cal_st: S.Streams, measured_specs: list) -> _Calibration:
  """The calibration streams swept over the grid and the measured specs emulated (fetch_all,
  the base every ppl increase is against, first)."""
  c = run.c
  grid = A.unique(measured_specs + list(c.grid or A.grid()))
  run.log(f"[frontier] calibration: {cal_st.tokens.shape[0]} streams x "
          f"{cal_st.tokens.shape[1]} tokens ({cal_st.num_docs} documents); {len(grid)} "
          f"policies swept; cost policy "
          f"{'in the grid' if A.cost_available() else 'not available (no cost rule yet)'}")
  logits = run.logits(cal_st)
  pts = run.sweep(logits, grid, "the calibration streams")
  run.log(f"[frontier] swept {len(pts)} policies ({run.clock()})")
  cal = _Calibration(logits, pts, {}, run.measurer(cal_st, "calibration"))
  index = cal.index
  for p in measured_specs[1:]:
    cal.measured[index[A.key(p)]] = cal.meas.metrics(p)
    run.log(f"[frontier] emulated {A.label(p)}: "
            f"{cal.measured[index[A.key(p)]]['ppl_increase_pct']:+.2f}% ({run.clock()})")
  cal.measured[index[A.key(measured_specs[0])]] = cal.meas.metrics(measured_specs[0])
  return cal


def _auto(run: _Run, cal: _Calibration, b: A.Budget):
  """The auto choice for budget `b` (`A.tune`): the knob swept finer around the choice the
  anchors' fit predicts (two rounds), then checked by emulation."""
  for _ in range(2):
    pts = cal.pts
    pred0 = cal.fit().predict([p.mass for p in pts])
    prof = b.profile or SPEEDUP_PROFILE
    cand = [p.policy.miss != "fetch_all" for p in pts]
    i0 = A.choose(pred0, [p.ms[prof] for p in pts], b, cand, [A.label(p.policy) for p in pts])
    index = cal.index
    new = [p for p in A.refine([p.policy for p in pts], i0) if A.key(p) not in index]
    if not new:
      break
    cal.pts += run.sweep(cal.logits, new, f"{len(new)} refined {A.knob(pts[i0].policy)} values")
    run.log(f"[frontier] refined around {A.label(cal.pts[i0].policy)}: {len(new)} more "
            f"policies swept ({run.clock()})")
  index = cal.index

  def measure(policy):
    m = cal.meas.metrics(policy)
    cal.measured[index[A.key(policy)]] = m
    run.log(f"[frontier] checked {A.label(policy)}: {m['ppl_increase_pct']:+.2f}% "
            f"({run.clock()})")
    return m["ppl_increase_pct"]
  ch = A.tune(cal.pts, {i: m["ppl_increase_pct"] for i, m in cal.measured.items()}, measure, b,
              max_checks=run.c.max_checks, profile=SPEEDUP_PROFILE)
  run.log(f"[frontier] auto for {b.describe()}: {A.label(cal.pts[ch.index].policy)}, "
          f"measured {ch.measured_pct:+.2f}% ({ch.reason})")
  return ch


def _calibration_points(cal: _Calibration, base_i: int, auto_idx: set, pred) -> list[dict]:
  """The measured calibration points, each with its role and whether it is on the
  measured Pareto front (projected ms against ppl increase)."""
  pts, base_m = cal.pts, cal.measured[base_i]
  points = []
  for i, m in cal.measured.items():
    role = ("fetch_all" if i == base_i else "auto" if i in auto_idx else
            "preset" if pts[i].policy.name else "threshold" if pts[i].policy.miss == "threshold"
            else "rule")
    points.append(_point(pts[i].policy, m, pts[i], base_m, pts[base_i], False, role,
                         float(pred[i])))
  front = A.pareto([q["projected_ms_per_token_rtx3090"] for q in points],
                   [q["ppl_increase_pct"] for q in points])
  for q, f in zip(points, front):
    q["pareto"] = bool(f)
  return points


def _heldout(run: _Run, hst: S.Streams, cal: _Calibration, base_i: int, autos, pred,
             points: list) -> dict:
  """The held-out split: fetch_all and each auto choice swept and emulated there (their
  points appended to `points`, each choice's `heldout_pct` set); the split's summary."""
  pts = cal.pts
  hpol = [pts[base_i].policy] + [pts[ch.index].policy for _, ch in autos]
  hpts = run.sweep(run.logits(hst), A.unique(hpol), "the held-out streams")
  hidx = {A.key(p.policy): p for p in hpts}
  hmeas = run.measurer(hst, "heldout")
  hb = hmeas.metrics(hpol[0])
  held = dict(ppl=hb["ppl"], waited_bf16_bytes_per_token=hb["waited_bf16_bytes_per_token"],
              streams=[int(x) for x in hst.tokens.shape], documents=hst.num_docs)
  hbase_sw = hidx[A.key(pts[base_i].policy)]
  points.append(_point(pts[base_i].policy, hb, hbase_sw, hb, hbase_sw, True, "fetch_all", 0.0))
  for _, ch in autos:
    p = pts[ch.index].policy
    m = hmeas.metrics(p)
    ch.heldout_pct = m["ppl_increase_pct"]
    points.append(_point(p, m, hidx[A.key(p)], hb, hbase_sw, True, "auto", float(pred[ch.index])))
    run.log(f"[frontier] held-out {A.label(p)}: {m['ppl_increase_pct']:+.2f}% ({run.clock()})")
  return held


def _report(run: _Run, cal_st: S.Streams, cal: _Calibration, base_i: int, autos, fit, pred,
            points: list, held: dict | None) -> dict:
  """The frontier as a JSON-ready dict (module docstring)."""
  c, shape, pts = run.c, run.shape, cal.pts
  base_m = cal.measured[base_i]
  base_ms = pts[base_i].ms[SPEEDUP_PROFILE]
  measured_keys = {A.key(pts[i].policy) for i in cal.measured}
  sw_front = A.pareto([p.ms[SPEEDUP_PROFILE] for p in pts], pred)
  return dict(
      cache_fraction=c.cache_fraction, shape=shape.name, profile=SPEEDUP_PROFILE,
      note="ppl_increase_pct: measured by the exact emulator (teacher-forced); projected_*: "
           "the time model on the simulator's per-layer counts of the same streams, tiled "
           f"over {shape.name}'s {shape.moe_layers} MoE layers, on the {SPEEDUP_PROFILE} "
           "roofline profile (PROJECTED, not measured); waited bytes counted in bf16",
      streams=dict(calibration=[int(x) for x in cal_st.tokens.shape], documents=cal_st.num_docs,
                   window=c.window, max_doc_tokens=c.max_doc_tokens,
                   split="documents alternate: even -> calibration, odd -> held-out"),
      fetch_all=dict(ppl=base_m["ppl"],
                     waited_bf16_bytes_per_token=base_m["waited_bf16_bytes_per_token"],
                     projected_ms_per_token_rtx3090=base_ms, heldout=held),
      cost_policy=A.cost_available(),
      fit=dict(kind=fit.describe(), mass=list(fit.mass), ppl_increase_pct=list(fit.dppl),
               pearson_r=fit.r, anchors=fit.anchors),
      auto=[dict(budget=dataclasses.asdict(b), policy=A.label(pts[ch.index].policy),
                 rule=pts[ch.index].policy.describe(), predicted_pct=ch.predicted_pct,
                 calibration_pct=ch.measured_pct, heldout_pct=getattr(ch, "heldout_pct", None),
                 projected_speedup_rtx3090=base_ms / pts[ch.index].ms[SPEEDUP_PROFILE],
                 checks=[dict(policy=a, predicted_pct=p, measured_pct=v) for a, p, v in ch.checks],
                 reason=ch.reason) for b, ch in autos],
      points=points,
      frontier=[q["policy"] for q in points if not q["heldout"] and q["pareto"]],
      sweep=[dict(policy=A.label(p.policy), rule=p.policy.describe(), sim_mass=p.mass,
                  predicted_ppl_increase_pct=float(pred[i]),
                  waited_bytes_ratio=p.fetches_per_token / max(pts[base_i].fetches_per_token,
                                                               1e-12),
                  projected_ms_per_token={k: v for k, v in p.ms.items()},
                  projected_speedup_rtx3090=base_ms / p.ms[SPEEDUP_PROFILE],
                  measured=A.key(p.policy) in measured_keys, pareto=bool(sw_front[i]))
             for i, p in enumerate(pts)],
      seconds=time.time() - run.t0)


def own_shape(cfg) -> hardware.ModelShape:
  """The named shape with the model's expert count and top-k, else the model's own byte
  counts (qwen3_moe-style, bf16)."""
  for m in hardware.MODELS.values():
    if (m.num_experts, m.top_k, m.moe_layers) == (cfg.num_experts, cfg.top_k,
                                                  len(cfg.moe_layers)):
      return m
  expert, active = hardware.moe_layer_bytes(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                            cfg.head_dim, cfg.num_experts, cfg.top_k,
                                            cfg.moe_intermediate_size)
  return hardware.ModelShape(f"this model ({cfg.model_type})", len(cfg.moe_layers),
                             cfg.num_experts, cfg.top_k, expert, active - cfg.top_k * expert,
                             cfg.vocab_size * cfg.hidden_size * 2)


AUTO = Config(streams=8, max_tokens=2048, taus=(0.05, 0.15), presets=(), heldout=False,
              bootstrap=200)


def auto_policy(cfg, params, store, tok, budget: A.Budget, out_dir: str, *,
                cache_fraction: float = 0.25, c: Config = AUTO, log=print, progress=None):
  """`--policy=auto`: the policy `autotune.tune` picks for `budget` on the calibration
  streams of the text that ships with moejax (`streams.calibration_documents`; no held-out
  run), projected times on the model's own shape; (policy, res)."""
  c = dataclasses.replace(c, cache_fraction=cache_fraction, budgets=(budget,),
                          shape=own_shape(cfg))
  res, chosen = build(cfg, params, store, tok, c, out_dir, log=log, progress=progress,
                      docs=S.calibration_documents(tok))
  return chosen[0], res