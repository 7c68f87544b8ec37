"""The offload presets side by side on the shipped demo model.

  moejax-demo             # installed; in a source checkout: python -m launch.demo
                          # (`bash launch/demo.sh` = set-up, then this)

Loads the demo model (./ckpts/demo under the current folder: a source checkout's),
keeps 25% of each layer's experts on the device, names the link (on a CPU-only machine an emulated link scaled to Qwen3-30B-A3B on an RTX
3090; the real copy on an accelerator), and decodes the same prompt greedily
under each preset (its own text), then times every preset on the same tokens:
the exact model's continuation, teacher-forced.  The engines take turns, --block
tokens at a time, so the load of a shared machine falls on all alike.  Prints one table (time per token, speed-up over baseline, hit rate,
share of expert calls substituted, substituted mass, perplexity increase over
the exact model on a fixed held-out slice), then the quality preset's text next
to the exact model's, and writes demo.json and demo.png under --out_dir.

`baseline` fetches every miss, so its output is the exact model's.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

from absl import flags
import numpy as np

from moejax.cli import app as cli
from moejax.cli import flagsets
from moejax import extras
from moejax.kernels import cpu_kernel

FLAGS = flags.FLAGS
PRESETS = ("baseline", "quality", "speed", "host", "substitute_all")
NO_EMULATOR = "n/a (emulator not available)"

flagsets.model_dir(what="Model folder")
flagsets.dtype()
flagsets.link()
flags.DEFINE_string("prompt", 'import os\n\n\ndef read_config(path):\n    """',
                    "Prompt every preset continues.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens each preset decodes (>= 2).")
flags.DEFINE_list("presets", list(PRESETS), "Presets or miss rules to compare; baseline "
                  "first (the exact model, and the speed-up reference).")
flags.DEFINE_float("cache_fraction", 0.25, "Share of each layer's experts resident.")
flags.DEFINE_integer("eval_tokens", 512, "Held-out tokens (in windows of --eval_window) for "
                     "the perplexity column.", lower_bound=0)
flags.DEFINE_integer("eval_window", 128, "Tokens per perplexity window.", lower_bound=2)
flags.DEFINE_integer("block", 8, "Tokens each engine decodes before the next one's turn.",
                     lower_bound=1)
flags.DEFINE_string("out_dir", "runs/demo", "Folder for demo.json and demo.png.")


def check_flags():
  if not FLAGS.presets or FLAGS.presets[0] != "baseline":
    raise cli.UsageError(f"--presets={','.join(FLAGS.presets)}: the list must start with "
                         "baseline (the exact model and the speed-up reference)")
  if len(set(FLAGS.presets)) != len(FLAGS.presets):
    raise cli.UsageError(f"--presets={','.join(FLAGS.presets)} names a preset twice")
  if FLAGS.max_new_tokens < 2:
    raise cli.UsageError(f"--max_new_tokens must be >= 2, got {FLAGS.max_new_tokens}")
  if FLAGS.model_dir is None:
    FLAGS.model_dir = cli.demo_model_dir()
  elif not os.path.exists(os.path.join(FLAGS.model_dir, "config.json")):
    raise cli.UsageError(f"--model_dir={FLAGS.model_dir!r} has no config.json (the demo model "
                         "ships in ckpts/demo of the source checkout)")


def progress(total: int, desc: str):
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, unit="", file=sys.stderr, leave=True, mininterval=0.5,
              bar_format="{desc:<28}{bar:30}| {n_fmt}/{total_fmt} [{elapsed}]")


# ------------------------------------------------------------------ decoding
def make_engines(cfg, params, store, link, dtype, max_len: int) -> dict:
  """One warmed-up OffloadEngine per preset, all on the same link object."""
  from moejax.offload.engine import EngineConfig, OffloadEngine
  from moejax.cache.policy import make_policy
  engines = {}
  bar = progress(len(FLAGS.presets), "compile (one per preset)")
  for name in FLAGS.presets:
    eng = OffloadEngine(cfg, params, store, EngineConfig.make(make_policy(name),
                                                              cache_fraction=FLAGS.cache_fraction,
                                                              link=link, max_len=max_len,
                                                              dtype=dtype))
    eng.warmup()
    engines[name] = eng
    bar.update()
  bar.close()
  return engines


def decode_side_by_side(engines: dict, prompt_ids: list[int], n: int, stop_ids,
                        forced: list[int] | None = None, desc: str = "decode") -> dict:
  """The engines take turns, --block tokens at a time, from a fresh prefill of the prompt.
  Without `forced`: each its greedy continuation; with it: every engine is fed the same
  tokens (teacher-forced).  Returns {preset: the tokens fed after the prompt}."""
  out = {name: [] for name in engines}
  logits = {}
  bar = progress(n * len(engines), desc)
  for name, eng in engines.items():
    logits[name] = eng.prefill(prompt_ids)
  live = set(engines)
  while live:
    for name, eng in engines.items():
      if name not in live:
        continue
      for _ in range(FLAGS.block):
        k = len(out[name])
        tok = int(np.argmax(logits[name])) if forced is None else forced[k]
        out[name].append(tok)
        bar.update()
        if (forced is None and tok in stop_ids) or len(out[name]) == n:
          bar.update(n - len(out[name]))
          live.discard(name)
          break
        logits[name] = eng.decode_step(tok)
  bar.close()
  return out


def time_same_tokens(engines: dict, prompt_ids: list[int], tokens: list[int]) -> dict:
  """Every engine decodes the same `tokens` (the exact model's continuation), so the
  timing and cache columns compare the presets on identical work.  -> {preset: the
  index of its first record of this pass} (for `stats(skip=...)`)."""
  first = {name: eng.stats()["tokens"] for name, eng in engines.items()}
  decode_side_by_side(engines, prompt_ids, len(tokens), (), forced=tokens,
                      desc="time (same tokens)")
  return first


# ------------------------------------------------------------------ perplexity
def heldout_tokens(tok, n: int) -> list[int]:
  """The first `n` tokens of the demo corpus' held-out split (files in sorted order)."""
  from moejax.train import data
  root, files = data.stdlib_files()
  ids: list[int] = []
  for rel in files:
    if data.is_heldout(rel):
      ids += tok.encode(data.read_text(os.path.join(root, rel)) + data.EOT)
      if len(ids) >= n:
        break
  return ids[:n]


def perplexity_increase(cfg, params, store, tokens: list[int], dtype) -> dict:
  """Per preset the teacher-forced perplexity on `tokens` (windows of --eval_window)
  under its decisions, from the exact emulator (moejax.research.emulator), and its increase
  over the exact model in percent.  Without the emulator: {"source": NO_EMULATOR}."""
  try:
    from moejax.research import emulator
  except ImportError:
    return {"source": NO_EMULATOR}
  from moejax.offload.config import EngineConfig
  w = FLAGS.eval_window
  n = len(tokens) - 1
  rows = n // w
  if rows < 1:
    return {"source": f"n/a (--eval_tokens={FLAGS.eval_tokens} is below one window of {w})"}
  arr = np.asarray(tokens[:rows * w + 1], np.int32)
  toks = np.stack([arr[i * w:(i + 1) * w] for i in range(rows)])
  tgts = np.stack([arr[i * w + 1:(i + 1) * w + 1] for i in range(rows)])
  pos = np.arange(w, dtype=np.int32)
  stacked = emulator.stack_layers(cfg, params, store.to_device(dtype))
  ppl = {}
  bar = progress(len(FLAGS.presets), "perplexity (emulator)")
  for name in FLAGS.presets:
    config = EngineConfig.make(name, cache_fraction=FLAGS.cache_fraction, max_len=w + 1,
                               dtype=dtype)
    em = emulator.make(cfg, params, store, config, stacked=stacked)
    nll = emulator.run_streams(em, toks, pos, tgts)["nll"]
    ppl[name] = float(np.exp(np.mean(nll)))
    bar.update()
  bar.close()
  exact = ppl[FLAGS.presets[0]]
  return {"source": "emulator (moejax.research.emulator: exact outputs, idealised transfers)",
          "tokens": int(toks.size), "windows": rows, "exact_ppl": exact, "ppl": ppl,
          "increase_pct": {k: 100.0 * (v / exact - 1.0) for k, v in ppl.items()}}


# ------------------------------------------------------------------ output
def rows_of(engines: dict, texts: dict, ppl: dict, skip: dict) -> dict:
  base = engines[FLAGS.presets[0]].stats(skip[FLAGS.presets[0]])["tpot_ms"]
  rows = {}
  for name, eng in engines.items():
    s = eng.stats(skip[name])
    rows[name] = dict(
        policy=eng.policy.describe(), tokens=s["tokens"], tpot_ms=s["tpot_ms"],
        speedup_vs_baseline=base / s["tpot_ms"], hit_rate=s["hit_rate"],
        substituted_call_pct=s["substituted_call_pct"],
        substituted_mass_per_token_layer=s["substituted_mass_per_token_layer"],
        fetches_per_token=s["fetches_per_token"],
        ppl=ppl.get("ppl", {}).get(name), ppl_increase_pct=ppl.get("increase_pct", {}).get(name),
        text=texts[name], stats=s)
  return rows


def table(rows: dict, ppl_source: str) -> str:
  head = ["preset", "ms/token", "speedup", "hit %", "subst. calls %", "subst. mass",
          "sync fetch/tok", "ppl vs exact"]
  lines = []
  for name, r in rows.items():
    inc = r["ppl_increase_pct"]
    lines.append([name, f"{r['tpot_ms']:.2f}", f"{r['speedup_vs_baseline']:.2f}x",
                  f"{100 * r['hit_rate']:.1f}", f"{r['substituted_call_pct']:.1f}",
                  f"{r['substituted_mass_per_token_layer']:.3f}",
                  f"{r['fetches_per_token']:.2f}",
                  "n/a" if inc is None else f"{inc:+.2f}%"])
  widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
  fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(cells, widths)))
  out = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(l) for l in lines]
  out.append("speedup: baseline's ms/token over the preset's, higher is faster (2.00x: half "
             "the time a token); substituted mass: gate mass of substituted experts per token "
             f"and MoE layer; ppl: {ppl_source}")
  return "\n".join(out)


WRAP_MARK = "\u21a9"      # ends a column's line that goes on in the next row


def side_by_side(left: str, right: str, titles: tuple[str, str], width: int = 46) -> str:
  """Two texts in columns of `width`; a longer line is wrapped, each of its rows but the
  last ending in WRAP_MARK."""
  def column(text):
    out = []
    for line in text.expandtabs(4).split("\n"):
      if len(line) <= width:
        out.append(line)
        continue
      rows = textwrap.wrap(line, width - 1, drop_whitespace=False, replace_whitespace=False)
      out += [r + WRAP_MARK for r in rows[:-1]] + rows[-1:]
    return out
  a, b = column(left), column(right)
  a += [""] * (len(b) - len(a))
  b += [""] * (len(a) - len(b))
  lines = [f"{titles[0]:<{width}} | {titles[1]}", f"{'-' * width}-+-{'-' * width}"]
  lines += [f"{x:<{width}} | {y}" for x, y in zip(a, b)]
  return "\n".join(lines)


def cores() -> int:
  """The cores this process may run on (its affinity mask where there is one)."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def busy_warning() -> str | None:
  """A warning when the 1-minute load average exceeds the cores: other processes then
  take CPU time from the engines, and the timing columns mean little."""
  try:
    load = os.getloadavg()[0]
  except (AttributeError, OSError):
    return None
  n = cores()
  if load <= n:
    return None
  return (f"warning: the machine is busy (load average {load:.1f} on {n} cores): the "
          "timings (ms/token, speedup) will be unreliable; run the demo on a quiet "
          "machine for figures to compare")


# ------------------------------------------------------------------ main
def main(argv):
  with cpu_kernel.decoding():   # decode loops throughout: the kernel helpers stay awake
    return _main(argv)


def _main(_):
  check_flags()
  t_start = time.time()
  busy = busy_warning()
  if busy:
    print(busy, file=sys.stderr, flush=True)
  from moejax.cache.policy import make_policy
  for name in FLAGS.presets:
    make_policy(name)                     # an unknown preset fails before any work
  run = _load()
  max_len = len(run["prompt_ids"]) + FLAGS.max_new_tokens + 1
  engines = make_engines(run["cfg"], run["params"], run["store"], run["link"], run["dtype"],
                         max_len)
  run["budget"] = next(iter(engines.values())).budget
  print(f"budget  {run['budget'].describe()}")
  try:
    run.update(_measure(engines, run))
  finally:
    for eng in engines.values():
      eng.close()
  run["busy"] = busy_warning() or busy        # the load during the run, else at its start
  _report(run, t_start)
  return 0


def _load() -> dict:
  """The model, tokenizer, prompt and (calibrated) link the demo runs, printed: a dict
  `_measure` and `_report` read."""
  import jax
  import jax.numpy as jnp
  from moejax.io.loader import load_model
  from moejax.offload.calibrate import calibrated_link
  from moejax.offload.link import default_spec
  from moejax.io.tokenizer import Tokenizer
  platform = jax.devices()[0].platform
  dtype = jnp.dtype(FLAGS.dtype)
  cfg, params, store = load_model(FLAGS.model_dir, dtype=dtype)
  tok = Tokenizer(os.path.join(FLAGS.model_dir, "tokenizer.json"))
  prompt_ids = tok.encode(FLAGS.prompt)
  if not prompt_ids:
    raise cli.UsageError("--prompt encodes to no tokens")
  spec = FLAGS.link or default_spec(platform)
  link = calibrated_link(spec, cfg, params, store, dtype)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
  n_params += sum(int(np.prod(v.shape)) for l in store.moe_layers
                  for v in store.stacked(l).values())
  print(f"model   {FLAGS.model_dir}: {cfg.model_type}, {cfg.num_layers} layers, "
        f"{cfg.num_experts} experts top-{cfg.top_k} per layer, {n_params / 1e6:.1f}M parameters, "
        f"{FLAGS.dtype}, on {platform}")
  print(f"link    {link.describe()}")
  return dict(cfg=cfg, params=params, store=store, tok=tok, prompt_ids=prompt_ids,
              dtype=dtype, spec=spec, link=link, n_params=n_params,
              device=str(jax.devices()[0]))


def _measure(engines: dict, run: dict) -> dict:
  """Each preset's text, its time per token on the exact model's tokens, and the
  perplexity increase (the emulator): the table's rows and what the report prints."""
  cfg, tok = run["cfg"], run["tok"]
  t0 = time.time()
  ids = decode_side_by_side(engines, run["prompt_ids"], FLAGS.max_new_tokens,
                            set(cfg.eos_token_ids), desc="decode (each its own text)")
  timed = ids[FLAGS.presets[0]]
  skip = (time_same_tokens(engines, run["prompt_ids"], timed) if len(timed) >= 2 else
          {name: 0 for name in engines})   # the exact model stopped at once: own texts
  decode_s = time.time() - t0
  texts = {name: tok.decode(v) for name, v in ids.items()}
  t0 = time.time()
  ppl = (perplexity_increase(cfg, run["params"], run["store"],
                             heldout_tokens(tok, FLAGS.eval_tokens + 1), run["dtype"])
         if FLAGS.eval_tokens else {"source": "n/a (--eval_tokens=0)"})
  return dict(timed=timed, texts=texts, ppl=ppl, decode_s=decode_s, ppl_s=time.time() - t0,
              rows=rows_of(engines, texts, ppl, skip))


def _report(run: dict, t_start: float):
  """The table, the side-by-side texts, demo.json and demo.png (the plotting extra)."""
  link, ppl, rows, texts, busy = run["link"], run["ppl"], run["rows"], run["texts"], run["busy"]
  print()
  if busy:
    print(busy)
  print(f"time per decoded token, every preset fed the exact model's greedy continuation "
        f"({len(run['timed'])} tokens; link: {link.describe()})")
  print(table(rows, ppl["source"]))
  print()
  print(side_by_side(FLAGS.prompt + texts["quality" if "quality" in texts else FLAGS.presets[-1]],
                     FLAGS.prompt + texts[FLAGS.presets[0]],
                     ("quality preset" if "quality" in texts else FLAGS.presets[-1],
                      "exact model (baseline)")))
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  json_path = os.path.join(FLAGS.out_dir, "demo.json")
  png_path = os.path.join(FLAGS.out_dir, "demo.png")
  result = dict(model_dir=FLAGS.model_dir, model_type=run["cfg"].model_type,
                parameters=run["n_params"], dtype=FLAGS.dtype, device=run["device"],
                link=link.describe(), link_spec=run["spec"], budget=run["budget"].as_dict(),
                prompt=FLAGS.prompt, max_new_tokens=FLAGS.max_new_tokens, block=FLAGS.block,
                timed_tokens=run["timed"],
                perplexity={k: v for k, v in ppl.items() if k not in ("ppl", "increase_pct")},
                presets=rows, load_average=os.getloadavg()[0] if hasattr(os, "getloadavg")
                else None, cores=cores(), busy_warning=busy, decode_wall_s=run["decode_s"],
                perplexity_wall_s=run["ppl_s"], total_wall_s=time.time() - t_start)
  with open(json_path, "w") as f:
    json.dump(result, f, indent=2, default=float)
  print()
  print(f"wrote {json_path}")
  try:
    from moejax.cli.demo_plot import plot
    plot(rows, png_path, f"demo model, {FLAGS.cache_fraction:.0%} of experts resident\n"
         f"{link.describe()}", ppl["source"])
    print(f"wrote {png_path}")
  except extras.MissingExtra as e:    # the table and demo.json stand without the plot
    print(f"skipped {png_path}: {e}")
  print(f"({time.time() - t_start:.0f} s in all, compilation included)")


def entry():
  """The console script `moejax-demo` (and `python -m launch.demo` from a checkout)."""
  cli.run(main)


if __name__ == "__main__":
  entry()
