"""moejax beside llama.cpp and transformers on CPU, same weights, interleaved runs.

  python -m launch.bench_peers --out=bench_peers.json

Not part of the tests.  First run: builds llama.cpp from the llama-cpp-python
source distribution into --llama_cache (see benchmarks/llama_cpp.py; skipped with a
message when there is no C++ compiler) and converts the models to GGUF there.
Then, per model (bench shape f32, demo f32, demo bf16; `--models=wide_bf16`: Qwen3-30B-A3B's
layer width at 4 layers, `benchmarks.models`, its experts read from the mapped file;
`--models=wide_q8_0,wide_q4_0,wide_q4_k_m`: the same model as ONE GGUF file that llama.cpp
and moejax both read, made once by llama.cpp from the bf16 GGUF (`models.wide_gguf`:
pure Q8_0 / Q4_0, every linear in the format; Q4_K_M: llama-quantize's mix), moejax
running it in place; transformers is skipped on these, the JSON names the file):
  * greedy text agreement llama.cpp vs the moejax Sampler (models with a tokenizer);
  * --rounds interleaved rounds; in each, every engine in turn decodes --decode_tokens
    tokens after a --prompt_len prompt, then prefills a --prefill_len prompt.  Every
    engine reads the same tokens: the held-out text of benchmarks/stream.py, teacher-forced
    (decode step i reads token --prompt_len + i; llama_timer reads the ids from a file),
    so all read the experts of the same routing, which the JSON reports (`routing`: the
    stream's LRU hit at 25% and 8-busiest share, from the router's logits on it).  Engines: llama.cpp (libllama through benchmarks/llama_timer.cpp,
    --threads threads, logits at the last prompt position as moejax's prefill),
    the moejax Sampler (one jitted decode step a token), `sampler_loop`: the Sampler's
    device loop (the --decode_tokens steps in one `lax.while_loop` call,
    Sampler.decode_loop), the OffloadEngine with every expert resident
    (cache_fraction 1.0, policy baseline; one jitted program per token, decoded as the
    Sampler is: greedy tokens stay on the device, `decode_step(tok, lazy=True)`, records
    read behind the device), and transformers (torch, --threads threads).
    `sampler_pool` / `engine_pool`: the same with the CPU kernel's decode helpers on
    XLA's thread pool instead of its own spinning threads (cpu_kernel.set_spin_us(0);
    before 2026-12-04).
Reported: best round's tok/s per engine (a shared machine only slows runs down), the
median, and ratios to llama.cpp (the faster of --threads and 1 thread: llama.cpp's
threads spin at barriers, so on a machine busier than its cores 2 threads collapse);
the load average at start and end.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks import models as bench_models
from benchmarks import llama_cpp, routing, stream
from moejax.kernels import cpu_kernel
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.io import traces
from moejax.model.sampler import Sampler, SamplingParams
from moejax.io.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_peers.json", "JSON results file.")
flags.DEFINE_list("models", ["bench_f32", "demo_f32", "demo_bf16"],
                  f"Models: {', '.join(bench_models.NAMES)}.")
flags.DEFINE_list("engines", ["llama.cpp", "sampler", "engine", "transformers"],
                  "Engines to time (also: sampler_loop, the Sampler's tokens in one device "
                  "loop; sampler_pool, engine_pool: the CPU kernel's decode helpers on "
                  "XLA's thread pool).")
flags.DEFINE_string("demo_dir", bench_models.DEMO_DIR, "The demo checkpoint.")
flags.DEFINE_string("llama_cache", llama_cpp.DEFAULT_CACHE,
                    "Where llama.cpp is built and the GGUF files are written.")
flags.DEFINE_integer("spin_us", 1000, "cpu_kernel.set_spin_us for every moejax engine "
                     "but the *_pool ones (which run with 0).")
flags.DEFINE_integer("threads", 2, "Threads of llama.cpp and torch.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens before decoding.")
flags.DEFINE_integer("decode_tokens", 256, "Decoded tokens timed (teacher-forced).")
flags.DEFINE_integer("prefill_len", 512, "Prompt length of the prefill measurement.")
flags.DEFINE_integer("rounds", 4, "Interleaved rounds.")
flags.DEFINE_string("agree_prompt", "def binary_search(items, target):\n",
                    "Prompt of the greedy agreement check.")
flags.DEFINE_integer("agree_tokens", 32, "Greedy tokens compared.")


def _rate(n: int, fn) -> float:
  t = time.perf_counter()
  fn()
  return n / (time.perf_counter() - t)


class SamplerRunner:
  def __init__(self, cfg, params, experts, dtype, max_len):
    self.s = Sampler(cfg, params, experts, max_len=max_len, dtype=dtype)

  def decode(self, prompt: np.ndarray, forced: np.ndarray) -> float:
    logits, cache = self.s.prefill(prompt[None])
    key, sp, t = jax.random.PRNGKey(0), SamplingParams(), len(prompt)
    logits.block_until_ready()
    def run():
      nonlocal cache
      for i, tok in enumerate(forced[:, None]):
        _, lg, cache = self.s.decode_step(cache, tok, t + i, sp, key)
      lg.block_until_ready()
    with cpu_kernel.decoding():     # a decode loop: the kernel's helpers spin between calls
      return _rate(FLAGS.decode_tokens, run)

  def prefill(self, prompt: np.ndarray) -> float:
    return _rate(len(prompt), lambda: self.s.prefill(prompt[None])[0].block_until_ready())


class SamplerLoopRunner(SamplerRunner):
  """The Sampler's device loop: the same decode steps as SamplerRunner (the forced tokens,
  --decode_tokens steps) in one `decode_loop` call."""

  def decode(self, prompt: np.ndarray, forced: np.ndarray) -> float:
    logits, cache = self.s.prefill(prompt[None])
    key = jax.random.PRNGKey(0)
    sp = SamplingParams(max_new_tokens=len(forced) + 1,   # no stop ids: all steps
                        forced_ids=tuple(int(t) for t in forced))
    logits.block_until_ready()
    def run():
      out, _, _ = self.s.decode_loop(cache, logits, len(prompt), sp, key)
      out.block_until_ready()
    return _rate(FLAGS.decode_tokens, run)


class EngineRunner:
  """Lazy steps (as the Sampler runs): the records are built when read, after the timed
  decode (their cost is reported apart)."""

  def __init__(self, cfg, params, store, dtype, max_len):
    self.build_ms = []     # per round: building the records, ms per token
    self.eng = OffloadEngine(cfg, params, store, EngineConfig.make("baseline", cache_fraction=1.0,
                                                                   max_len=max_len, dtype=dtype))
    self.eng.warmup()

  def decode(self, prompt: np.ndarray, forced: np.ndarray) -> float:
    self.eng.prefill([int(t) for t in prompt])
    def run():
      for tok in forced:
        lg = self.eng.decode_step(int(tok), lazy=True)
      jax.block_until_ready(lg)
    with cpu_kernel.decoding():
      rate = _rate(FLAGS.decode_tokens, run)
    t = time.perf_counter()     # the records, built when read (not in the decode time)
    assert len(self.eng.records) >= FLAGS.decode_tokens
    self.build_ms.append((time.perf_counter() - t) * 1e3 / FLAGS.decode_tokens)
    return rate

  def prefill(self, prompt: np.ndarray) -> float:
    return _rate(len(prompt), lambda: self.eng.prefill([int(t) for t in prompt]))


class PoolRunner:
  """`inner` with the CPU kernel's decode calls shared with XLA's thread pool (spin 0)."""

  def __init__(self, inner):
    self.inner = inner

  def _with_pool(self, fn, prompt):
    cpu_kernel.set_spin_us(0)
    try:
      return fn(prompt)
    finally:
      cpu_kernel.set_spin_us(FLAGS.spin_us)

  def decode(self, prompt: np.ndarray, forced: np.ndarray) -> float:
    cpu_kernel.set_spin_us(0)
    try:
      return self.inner.decode(prompt, forced)
    finally:
      cpu_kernel.set_spin_us(FLAGS.spin_us)

  def prefill(self, prompt: np.ndarray) -> float:
    return self._with_pool(self.inner.prefill, prompt)


class TransformersRunner:
  def __init__(self, hf_dir: str, dtype):
    import torch
    import transformers
    torch.set_num_threads(FLAGS.threads)
    self.torch = torch
    tdt = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
    self.impl = None
    for impl in ("grouped_mm", "eager"):  # the first this version has
      try:
        self.m = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=tdt, attn_implementation="sdpa", experts_implementation=impl).eval()
        self.impl = impl
        break
      except Exception:  # pylint: disable=broad-except  (an implementation missing here)
        continue
    if self.impl is None:
      raise RuntimeError(f"transformers cannot load {hf_dir}")

  def decode(self, prompt: np.ndarray, forced: np.ndarray) -> float:
    torch = self.torch
    with torch.inference_mode():
      past = self.m(torch.tensor(prompt[None]), use_cache=True, logits_to_keep=1).past_key_values
      def run():
        nonlocal past
        for tok in forced:
          past = self.m(torch.tensor([[int(tok)]]), past_key_values=past,
                        use_cache=True).past_key_values
      return _rate(FLAGS.decode_tokens, run)

  def prefill(self, prompt: np.ndarray) -> float:
    with self.torch.inference_mode():
      return _rate(len(prompt), lambda: self.m(self.torch.tensor(prompt[None]), use_cache=True,
                                               logits_to_keep=1))


class LlamaRunner:
  """llama.cpp through benchmarks/llama_timer.cpp: one process per round times both."""

  def __init__(self, bins, gguf, threads: int, ids_file: str):
    self.bins, self.gguf, self.threads, self.ids_file = bins, gguf, threads, ids_file

  def round(self, prompt: np.ndarray, forced: np.ndarray, long: np.ndarray):
    r = llama_cpp.time_run(self.bins, self.gguf, self.threads, len(long), len(prompt),
                           len(forced), self.ids_file)
    return r["decode_tok_s"], r["prefill_tok_s"]


def one_round(runner, prompt: np.ndarray, forced: np.ndarray, long: np.ndarray):
  """(decode tok/s, prefill tok/s) of one round of `runner` on the stream's tokens: the
  prompt, then `forced` decoded one at a time; the prefill of `long`."""
  if isinstance(runner, LlamaRunner):
    return runner.round(prompt, forced, long)
  return runner.decode(prompt, forced), runner.prefill(long)


def agreement(bins, gguf, sampler: SamplerRunner, tok_path: str) -> dict:
  tok = Tokenizer(tok_path)
  ids = sampler.s.generate(tok.encode(FLAGS.agree_prompt),  # llama-simple stops at EOS too
                           SamplingParams(max_new_tokens=FLAGS.agree_tokens,
                                          stop_ids=sampler.s.cfg.eos_token_ids))
  ours = tok.decode(ids)
  theirs = llama_cpp.greedy_text(bins, gguf, FLAGS.agree_prompt, FLAGS.agree_tokens)
  common = len(os.path.commonprefix([ours, theirs]))
  return {"prompt": FLAGS.agree_prompt, "tokens": FLAGS.agree_tokens, "moejax": ours,
          "llama.cpp": theirs, "equal": ours == theirs or (
              common >= min(len(ours), len(theirs)) and common > 0),
          "common_prefix_chars": common}


def stream_routing(cfg, params, store, ids, dtype) -> dict:
  """The routing every engine reads on the stream: its router logits, teacher-forced in
  one window, as `launch.trace` records them (benchmarks/routing.stats)."""
  logits, _ = traces.record_router_logits(cfg, params, store, ids, seq=len(ids), batch=1,
                                          dtype=dtype)
  return routing.stats(routing.top_k_ids(logits, cfg.top_k), cfg.num_experts)


def bench_model(name: str, bins, work: str) -> dict:
  kind, dtype = bench_models.split_name(name)
  cfg, params, store, hf_dir, tok_path = bench_models.load(name, FLAGS.demo_dir)
  if kind == "bench":
    hf_dir = bench_models.save_bench(os.path.join(work, "bench_hf"), FLAGS.demo_dir)
  max_len = max(FLAGS.prompt_len + FLAGS.decode_tokens, FLAGS.prefill_len) + 8
  runners, res = {}, {"engines": {}}
  # the one token stream (every model here reads the demo tokenizer's ids: vocab >= 8192)
  ids = np.asarray(stream.held_out_ids(tok_path or os.path.join(FLAGS.demo_dir, "tokenizer.json"),
                                       max_len - 7), np.int32)
  prompt, long = ids[:FLAGS.prompt_len], ids[:FLAGS.prefill_len]
  forced = ids[FLAGS.prompt_len:FLAGS.prompt_len + FLAGS.decode_tokens]
  fmt = bench_models.weights_of(name)
  res["weights"] = fmt
  if fmt in bench_models.GGUF_FORMATS:    # both engines read this one file
    res["gguf"] = bench_models.wide_gguf(4, fmt, cache=FLAGS.llama_cache)
  if "llama.cpp" in FLAGS.engines and bins:
    gguf = (res.get("gguf") or bench_models.wide_gguf(4, "bf16", cache=FLAGS.llama_cache)
            if kind == "wide" else
            llama_cpp.convert(FLAGS.llama_cache, hf_dir, "bf16" if dtype == jnp.bfloat16
                              else "f32", os.path.join(FLAGS.llama_cache, "gguf")))
    ids_file = stream.write_ids(os.path.join(work, f"{name}_stream.txt"), ids)
    runners["llama.cpp"] = LlamaRunner(bins, gguf, FLAGS.threads, ids_file)
    if FLAGS.threads > 1:  # its threads spin at barriers: on a busy machine 1 can win
      runners["llama.cpp_1t"] = LlamaRunner(bins, gguf, 1, ids_file)
  if "sampler" in FLAGS.engines or "llama.cpp" in runners:
    runners["sampler"] = SamplerRunner(cfg, params, store.device_experts(), dtype, max_len)
  if "sampler_loop" in FLAGS.engines:
    runners["sampler_loop"] = SamplerLoopRunner(cfg, params, store.device_experts(), dtype,
                                                  max_len)
  if "engine" in FLAGS.engines:
    runners["engine"] = EngineRunner(cfg, params, store, dtype, max_len)
  if "sampler_pool" in FLAGS.engines:
    runners["sampler_pool"] = PoolRunner(SamplerRunner(cfg, params, store.device_experts(), dtype,
                                                       max_len))
  if "engine_pool" in FLAGS.engines:
    runners["engine_pool"] = PoolRunner(EngineRunner(cfg, params, store, dtype, max_len))
  if "transformers" in FLAGS.engines and fmt in bench_models.GGUF_FORMATS:
    print(f"[bench_peers] {name}: transformers skipped (it would run the bf16 safetensors, "
          f"not the GGUF's {fmt} blocks)", file=sys.stderr)
  elif "transformers" in FLAGS.engines:
    runners["transformers"] = TransformersRunner(hf_dir, dtype)
    res["transformers_experts_implementation"] = runners["transformers"].impl
  if "llama.cpp" in runners and tok_path:
    res["agreement"] = agreement(bins, runners["llama.cpp"].gguf, runners["sampler"], tok_path)
    print(f"[bench_peers] {name}: greedy text llama.cpp vs moejax "
          f"{'AGREE' if res['agreement']['equal'] else 'DIFFER'} "
          f"({res['agreement']['common_prefix_chars']} common characters)", file=sys.stderr)
  res["routing"] = stream_routing(cfg, params, store, ids[:FLAGS.prompt_len + len(forced)],
                                  dtype)
  for r in runners.values():  # compile / warm up (llama_timer warms up on its own)
    if not isinstance(r, LlamaRunner):
      one_round(r, prompt, forced, long)
  rates = {e: {"decode": [], "prefill": []} for e in runners}
  for _ in tqdm(range(FLAGS.rounds), desc=f"{name}: rounds"):
    for e, r in runners.items():
      d, p = one_round(r, prompt, forced, long)
      rates[e]["decode"].append(d)
      rates[e]["prefill"].append(p)
  for e in runners:
    d, p = rates[e]["decode"], rates[e]["prefill"]
    res["engines"][e] = {"decode_tok_s": max(d), "prefill_tok_s": max(p),
                         "decode_tok_s_median": statistics.median(d),
                         "prefill_tok_s_median": statistics.median(p),
                         "decode_rounds": d, "prefill_rounds": p}
    if isinstance(runners[e], EngineRunner):   # its records' cost, paid when read
      res["engines"][e]["record_build_ms_per_token"] = runners[e].build_ms[1:]
  if "llama.cpp" in runners:  # ratios to llama.cpp's faster thread count, per metric
    ref = {m: max(v[m] for e, v in res["engines"].items() if e.startswith("llama.cpp"))
           for m in ("decode_tok_s", "prefill_tok_s")}
    med = {m: max(v[f"{m}_median"] for e, v in res["engines"].items()
                  if e.startswith("llama.cpp")) for m in ("decode_tok_s", "prefill_tok_s")}
    for e, v in res["engines"].items():
      v["decode_ratio_to_llama_cpp"] = v["decode_tok_s"] / ref["decode_tok_s"]
      v["prefill_ratio_to_llama_cpp"] = v["prefill_tok_s"] / ref["prefill_tok_s"]
      v["decode_median_ratio_to_llama_cpp"] = v["decode_tok_s_median"] / med["decode_tok_s"]
      v["prefill_median_ratio_to_llama_cpp"] = (v["prefill_tok_s_median"]
                                                / med["prefill_tok_s"])
  if "sampler" in res["engines"]:          # the engine's targets are ratios to the Sampler
    ref = res["engines"]["sampler"]
    for e, v in res["engines"].items():
      v["decode_median_ratio_to_sampler"] = (v["decode_tok_s_median"]
                                             / ref["decode_tok_s_median"])
      v["decode_ratio_to_sampler"] = v["decode_tok_s"] / ref["decode_tok_s"]
      v["prefill_ratio_to_sampler"] = v["prefill_tok_s"] / ref["prefill_tok_s"]
  for r in runners.values():
    r = getattr(r, "inner", r)
    if isinstance(r, EngineRunner):
      r.eng.close()
  return res


def main(_):
  cpu_kernel.set_spin_us(FLAGS.spin_us)
  bins = None
  if "llama.cpp" in FLAGS.engines:
    try:
      bins = llama_cpp.build(FLAGS.llama_cache)
    except llama_cpp.Unavailable as e:
      print(f"[bench_peers] llama.cpp skipped: {e}", file=sys.stderr)
  work = os.path.join(FLAGS.llama_cache, "models")
  bench_models.run_all(
      {"threads": FLAGS.threads, "prompt_len": FLAGS.prompt_len,
       "decode_tokens": FLAGS.decode_tokens, "prefill_len": FLAGS.prefill_len,
       "rounds": FLAGS.rounds, "spin_us": FLAGS.spin_us,
       "llama_cpp": f"llama-cpp-python {llama_cpp.VERSION} vendored llama.cpp" if bins
                    else "skipped"},
      FLAGS.models, lambda name: bench_model(name, bins, work), FLAGS.out, table)


def _x(v: dict, m: dict, metric: str) -> str:
  ref = [u[f"{metric}_tok_s_median"] for e, u in m["engines"].items()
         if e.startswith("llama.cpp")]
  return f" ({v[f'{metric}_tok_s_median'] / max(ref):.2f}x)" if ref else ""


def table(res: dict) -> str:
  lines = [f"tok/s, best of {res['rounds']} interleaved rounds (x = ratio to llama.cpp's "
           f"faster thread count, x smp = decode ratio to the moejax Sampler); "
           f"load average {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
           f"{'model':<13}{'engine':<16}{'decode':>10}{'x':>7}{'x smp':>7}{'prefill':>10}"
           f"{'x':>7}   median decode, prefill (x llama.cpp's medians)"]
  for name, m in res["models"].items():
    for e, v in m["engines"].items():
      rd, rp = v.get("decode_ratio_to_llama_cpp"), v.get("prefill_ratio_to_llama_cpp")
      rs = v.get("decode_ratio_to_sampler")
      lines.append(f"{name:<13}{e:<16}{v['decode_tok_s']:>10.1f}"
                   f"{f'{rd:.2f}' if rd else '-':>7}{f'{rs:.2f}' if rs else '-':>7}"
                   f"{v['prefill_tok_s']:>10.1f}"
                   f"{f'{rp:.2f}' if rp else '-':>7}   {v['decode_tok_s_median']:.1f}"
                   f"{_x(v, m, 'decode')}, {v['prefill_tok_s_median']:.1f}"
                   f"{_x(v, m, 'prefill')}")
    rt = m.get("routing")
    if rt:
      lines.append(f"{name:<13}the stream's routing: an LRU of 25% hits {rt['lru_hit_mean']:.3f} "
                   f"(shuffled {rt['lru_hit_shuffled_mean']:.3f}); the 8 busiest experts "
                   f"take up to {rt['busiest8_share_max']:.1%} of a layer's calls")
  return "\n".join(lines)
