"""Engine III on a GPU: exactness, the presets against their lower bound, the loops.

  python -m launch.bench_gpu --out=gpu_check.json [--presets_only] [--quick]
  (--quick: a small shape instead of Qwen3-30B-A3B's, to smoke-test on a CPU;
   --presets_only: the shorter run, exactness and the four offloaded presets at 25%)

1. Exactness on a tiny random f32 model with a pinned_host store: the engine's fetch_all
   logits against the Sampler's (every expert resident), and the engine's decisions
   against the emulator's (quality preset).
2. The Qwen3-30B-A3B shape (random weights, 8 layers, bf16, 25% resident, pinned_host
   store, native link): per preset the time per token (teacher-forced, one synchronous
   step per token), the waited fetches per token, and the lower bound = the Sampler's
   step (every expert resident) + waited fetches x one expert's in-program copy time
   (a jitted dynamic slice of the pinned store moved into a slot, timed here); the
   all-resident engine against the Sampler.
3. The demo model: tok/s of the Sampler per token, the Sampler's on-device loop and the
   engine's on-device loop (`generate`), and the all-resident engine per token.
Writes --out after each part (a part that fails is reported there and the run goes on)
and prints it.  Until 2026-12-05 this was docs/lab/runs/2026-12-04-engine3's script
(`gpu_check.py OUT_DIR [--quick] [--presets_only]`, writing OUT_DIR/gpu_check.json).
"""

import dataclasses
import functools
import json
import time
import traceback

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from moejax.research import emulator
from moejax.io import loader
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer
from moejax.io import store as host_store
from moejax.io import placement
from moejax.offload import decode
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.model.sampler import Sampler, SamplingParams
from moejax.io.store import ExpertStore

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "gpu_check.json", "JSON results file (written after each part).")
flags.DEFINE_bool("quick", False, "A small shape instead of Qwen3-30B-A3B's (a CPU smoke run).")
flags.DEFINE_bool("presets_only", False, "The shorter run: exactness, then the four offloaded "
                  "presets at 25% on the Qwen3-30B-A3B shape (about 5 minutes on an H200).")

_T0 = [time.perf_counter()]   # the time budget of the presets counts from here


def log(*a):
  print(f"[{time.perf_counter() - _T0[0]:6.1f}s]", *a, flush=True)


def cfg_of(n, hidden, heads, kv, hd, e, k, inter, vocab):
  return ModelConfig(model_type="qwen3_moe", vocab_size=vocab, hidden_size=hidden,
                     num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                     num_experts=e, top_k=k, moe_intermediate_size=inter,
                     intermediate_size=4 * hidden, sparse_layers=(True,) * n, qk_norm="head",
                     norm_topk_prob=True).validate()


def random_model(cfg, dtype, seed=0):
  """Params (jax init) and one random expert table shared by every layer (fast on a GPU)."""
  key = jax.random.PRNGKey(seed)
  shapes = loader.expert_shapes(cfg)
  table = {k: np.asarray(jax.random.normal(jax.random.fold_in(key, i),
                                           (cfg.num_experts,) + v, dtype) * 0.02)
           for i, (k, v) in enumerate(shapes.items())}
  exps = [table] * cfg.num_layers
  abstract = [{k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in t.items()} for t in exps]
  params = jax.jit(lambda k: Transformer(cfg, dtype).init(
      k, jnp.zeros((1, 2), jnp.int32), [{n: jnp.zeros(a.shape, a.dtype) for n, a in t.items()}
                                        for t in abstract])["params"])(key)
  return params, ExpertStore.from_stacked(exps)


def timed_steps(step, n):
  jax.block_until_ready(step(0))
  t = time.perf_counter()
  for i in range(n):
    out = step(i + 1)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / n * 1e3


# ---------------------------------------------------------------- 1. exactness
def exactness(res):
  cfg = cfg_of(3, 64, 4, 2, 16, 16, 4, 32, 256)
  params, store = random_model(cfg, jnp.float32, 1)
  pinned = host_store.make_store(store, "pinned_host")
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 256, 24).tolist()
  smp = Sampler(cfg, params, store.to_device(jnp.float32), max_len=64)
  lg, cache = smp.prefill(np.asarray([toks[:8]]))
  ref = [np.asarray(lg[0])]
  for i, t in enumerate(toks[8:]):
    _, l2, cache = smp.decode_step(cache, np.asarray([t], np.int32), 8 + i, SamplingParams(),
                                   jax.random.PRNGKey(0))
    ref.append(np.asarray(l2[0]))
  out = {}
  for pol in ("baseline", "quality"):
    with OffloadEngine(cfg, params, pinned,
                       EngineConfig.make(pol, cache_fraction=0.25, max_len=64)) as eng:
      got = [eng.prefill(toks[:8])] + [eng.decode_step(t) for t in toks[8:]]
      recs = eng.records
    if pol == "baseline":
      out["fetch_all_max_abs_diff_vs_sampler"] = float(np.max(np.abs(np.stack(got) -
                                                                      np.stack(ref))))
      out["baseline_fetches_per_token"] = float(np.mean([r.fetches for r in recs]))
    else:
      em = emulator.make(cfg, params, store,
                         EngineConfig.make(pol, cache_fraction=0.25, max_len=64), detail=True)
      # the emulator's stream is teacher-forced from one first token: prompt of 1 token
      with OffloadEngine(cfg, params, pinned,
                         EngineConfig.make(pol, cache_fraction=0.25, max_len=64)) as eng:
        eng.prefill(toks[:1])
        for t in toks[1:]:
          eng.decode_step(t)
        recs = eng.records
      r = emulator.run_streams(em, np.asarray([toks]), np.arange(len(toks)),
                               np.asarray([toks[1:] + [0]]))
      eng_act = np.asarray([[r_.layers[l].actions for l in cfg.moe_layers] for r_ in recs])
      out["quality_actions_equal_emulator"] = bool(np.array_equal(eng_act, r["action"][0]))
      out["quality_ids_equal_emulator"] = bool(np.array_equal(
          np.asarray([[r_.layers[l].ids for l in cfg.moe_layers] for r_ in recs]), r["ids"][0]))
  res["exactness"] = out
  log("exactness", out)


# ---------------------------------------------------------------- 2. Qwen3-30B shape
def copy_ms(store_l, eng_states, n=50):
  """One expert's in-program copy: a dynamic slice of the pinned store moved into a slot
  (8 per call, the call's time / 8)."""
  dev = jax.devices()[0]
  arrs, pinned = placement.program_store(store_l, dev)
  layer = arrs[next(iter(arrs))]
  buf = {k: jnp.zeros((8,) + v.shape[1:], v.dtype) for k, v in layer.items()}

  @functools.partial(jax.jit, donate_argnums=(1,))
  def one(layer, buf, e):        # 8 experts, one after another, as a decode step's copies
    out = dict(buf)
    for j in range(8):
      for k, b in out.items():
        row = jax.lax.dynamic_slice_in_dim(layer[k], (e + 7 * j) % 128, 1, axis=0)
        if pinned:
          row = jax.device_put(row, jax.sharding.SingleDeviceSharding(dev, memory_kind="device"))
        out[k] = jax.lax.dynamic_update_slice_in_dim(b, row, j, axis=0)
    return out
  del eng_states
  buf = one(layer, buf, 0)
  jax.block_until_ready(buf)
  t = time.perf_counter()
  for i in range(n):
    buf = one(layer, buf, i % 100)
  jax.block_until_ready(buf)
  return (time.perf_counter() - t) / n / 8 * 1e3


def qwen_shape(res, quick=False, presets_only=False):
  layers = 8
  cfg = (cfg_of(layers, 256, 4, 2, 64, 32, 8, 128, 1024) if quick  # a CPU smoke run
         else cfg_of(layers, 2048, 32, 4, 128, 128, 8, 768, 151936))
  dt = jnp.bfloat16
  params, store = random_model(cfg, dt, 2)
  pinned = host_store.make_store(store, "pinned_host")
  log("qwen shape built")
  rng = np.random.default_rng(1)
  toks = rng.integers(0, cfg.vocab_size, 200).tolist()
  n_warm, n_tok = 16, 64
  out = {"layers": layers, "expert_bytes": store.expert_nbytes()}
  smp = Sampler(cfg, params, store.to_device(dt), max_len=256, dtype=dt)
  lg, cache = smp.prefill(np.asarray([toks[:16]]))
  state = {"cache": cache}

  def sstep(i):
    tok, l2, state["cache"] = smp.decode_step(state["cache"], np.asarray([toks[16 + i]], np.int32),
                                              16 + i, SamplingParams(), jax.random.PRNGKey(0))
    np.asarray(l2)                       # the engine's step reads its logits back too
    return l2
  out["sampler_tpot_ms"] = timed_steps(sstep, n_warm + n_tok)
  log("sampler", out["sampler_tpot_ms"])
  out["copy_ms"] = copy_ms(pinned, None)
  log("copy", out["copy_ms"])
  del smp
  presets = {}
  runs = (("baseline", 1.0, False), ("baseline", 0.25, False), ("quality", 0.25, False),
          ("speed", 0.25, False), ("substitute_all", 0.25, False), ("quality", 0.25, True),
          ("baseline", 0.25, True))
  if presets_only:     # a second, shorter run: the offloaded presets
    runs = runs[1:5]
  for pol, frac, loops in runs:
    name = f"{pol}@{frac}" + ("+loops" if loops else "")
    if time.perf_counter() - _T0[0] > (300 if presets_only else 420):
      presets[name] = "skipped: out of time"
      continue
    with OffloadEngine(cfg, params, pinned, EngineConfig.make(pol, cache_fraction=frac, max_len=256,
                                                              dtype=dt)) as eng:
      if loops:   # an A/B of the copy mechanism: the CPU backend's conds + while loops
        eng._prog = dataclasses.replace(eng._prog, ctx=dataclasses.replace(eng._prog.ctx,
                                                                          skip_empty=True))
        eng._step = decode.step_fn(eng._prog)
      eng.warmup()
      eng.prefill(toks[:16])
      for i in range(n_warm):
        eng.decode_step(toks[16 + i])
      t = time.perf_counter()
      for i in range(n_tok):
        eng.decode_step(toks[16 + n_warm + i])
      ms = (time.perf_counter() - t) / n_tok * 1e3
      st = eng.stats(skip=n_warm)
    bound = out["sampler_tpot_ms"] + st["fetches_per_token"] * out["copy_ms"]
    presets[name] = dict(tpot_ms=ms, fetches_per_token=st["fetches_per_token"],
                         admissions_per_token=st["admissions_per_token"],
                         hit_rate=st["hit_rate"], lower_bound_ms=bound,
                         over_bound=ms / bound, over_sampler=ms / out["sampler_tpot_ms"])
    log(name, presets[name])
  out["presets"] = presets
  res["qwen3_30b_shape"] = out


# ---------------------------------------------------------------- 3. demo loops
def demo_loops(res):
  cfg, params, store = loader.load_model("ckpts/demo", dtype=jnp.float32)[:3]
  prompt = list(range(5, 69))
  n = 128
  sp = SamplingParams(max_new_tokens=n)
  out = {}
  smp = Sampler(cfg, params, store.to_device(jnp.float32), max_len=512)
  smp.generate(prompt, sp)
  t = time.perf_counter(); toks_a = smp.generate(prompt, sp); dt_a = time.perf_counter() - t
  smp.generate_loop(prompt, sp)
  t = time.perf_counter(); toks_b = smp.generate_loop(prompt, sp); dt_b = time.perf_counter() - t
  out["sampler_per_token_tok_s"] = n / dt_a
  out["sampler_loop_tok_s"] = n / dt_b
  out["sampler_loop_same_tokens"] = toks_a == toks_b
  with OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=1.0,
                                                           max_len=512)) as eng:
    eng.warmup()
    eng.generate(prompt, sp)
    t = time.perf_counter(); toks_c = eng.generate(prompt, sp); dt_c = time.perf_counter() - t
    out["engine_loop_tok_s"] = n / dt_c
    out["engine_loop_same_tokens"] = toks_c == toks_a
    t = time.perf_counter(); eng.generate(prompt, sp, on_token=lambda x: None)
    out["engine_per_token_tok_s"] = n / (time.perf_counter() - t)
  with OffloadEngine(cfg, params, store, EngineConfig.make("quality", cache_fraction=0.25,
                                                           max_len=512)) as eng:
    eng.warmup()
    eng.generate(prompt, sp)
    t = time.perf_counter(); eng.generate(prompt, sp); dt_d = time.perf_counter() - t
    out["engine_quality_loop_tok_s"] = n / dt_d
  out["loop_over_sampler_per_token"] = out["sampler_loop_tok_s"] / out["sampler_per_token_tok_s"]
  out["engine_loop_over_sampler_per_token"] = (out["engine_loop_tok_s"]
                                               / out["sampler_per_token_tok_s"])
  res["demo"] = out
  log("demo", out)


def run(out: str, quick: bool = False, presets_only: bool = False) -> dict:
  """The parts in order (presets_only: exactness and the presets); `out` is rewritten
  after each part, a failing part recorded as `<part>_error`."""
  res = {"device": str(jax.devices()[0]), "jax": jax.__version__}
  parts = [("exactness", exactness)] + ([] if presets_only else [("demo_loops", demo_loops)])
  parts.append(("qwen_shape", lambda r: qwen_shape(r, quick, presets_only)))
  for name, part in parts:
    try:
      part(res)
    except Exception as e:  # pylint: disable=broad-except  (report and go on)
      traceback.print_exc()
      res[name + "_error"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
      json.dump(res, f, indent=1, default=str)
  print(json.dumps(res, indent=1, default=str))
  return res


def main(_):
  run(FLAGS.out, quick=FLAGS.quick, presets_only=FLAGS.presets_only)
