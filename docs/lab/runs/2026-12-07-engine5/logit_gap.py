"""Where moejax's and llama.cpp's greedy texts part on a wide GGUF model: moejax's logits
along llama.cpp's own tokens (teacher-forced), the top-two gap at each step and the logit
moejax gives llama.cpp's choice at the first step where the two choices differ.

  PYTHONPATH=. python docs/lab/runs/2026-12-07-engine5/logit_gap.py wide_q4_k_m OUT.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import llama_cpp, models as bench_models
from moejax.io.tokenizer import Tokenizer
from moejax.model.sampler import Sampler, SamplingParams

name, out = sys.argv[1], sys.argv[2]
PROMPT, N = "def binary_search(items, target):\n", 32
cfg, params, store, _, tok_path = bench_models.load(name)
gguf = bench_models.wide_gguf(4, bench_models.weights_of(name))
tok = Tokenizer(tok_path)
theirs = llama_cpp.greedy_text(llama_cpp.binaries(llama_cpp.DEFAULT_CACHE), gguf, PROMPT, N)
p_ids, t_ids = tok.encode(PROMPT), tok.encode(PROMPT + theirs)
assert t_ids[:len(p_ids)] == p_ids, "the prompt's tokens change when the text is appended"
s = Sampler(cfg, params, store.device_experts(), max_len=128, dtype=jnp.bfloat16)
logits, cache = s.prefill(np.asarray(p_ids, np.int32)[None])
rows, key, sp = [], jax.random.PRNGKey(0), SamplingParams()
for i, nxt in enumerate(t_ids[len(p_ids):]):
  lg = np.asarray(logits, np.float32).reshape(-1)
  top2 = np.argsort(lg)[::-1][:2]
  rows.append({"step": i, "llama_cpp": int(nxt), "moejax": int(top2[0]),
               "gap_top2": float(lg[top2[0]] - lg[top2[1]]),
               "gap_to_llama_cpp": float(lg[top2[0]] - lg[nxt])})
  _, logits, cache = s.decode_step(cache, np.asarray([nxt], np.int32),
                                   len(p_ids) + i, sp, key)
first = next((r for r in rows if r["moejax"] != r["llama_cpp"]), None)
gaps = [r["gap_top2"] for r in rows]
res = {"model": name, "prompt": PROMPT, "llama_cpp_text": theirs, "steps": len(rows),
       "first_divergence": first, "median_gap_top2": float(np.median(gaps)),
       "logit_range": "moejax's logits at the step (bf16 compute)", "rows": rows}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
