"""A request's tokens from the engine: `OffloadEngine.generate` as it is, or, when the
request asks for log-probabilities or penalties, the same per-token loop with them.

    lps = []                     # (lp, [(id, lp)] of the top best) per token, as they come
    tokens = generate(eng, ids, sp, seed, on_token, top=1, logprobs=lps, presence=0.5)

The loop is `sampler.token_loop`'s: the same key schedule and `next_token`, each next
logits from `eng.decode_step` (under the policy), so with zero penalties the tokens are
the ones `generate` gives.  Penalties follow OpenAI: logits[t] -= presence * (count[t] > 0)
+ frequency * count[t] over the tokens generated so far in this request
(`sampler.next_token_penalized`).  A token's log-probability is read from the raw logits
of its step (before penalties, temperature and top_p).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel
from moejax.model.sampler import next_token, next_token_penalized
from moejax.serve.logprobs import token_logprob


def generate(eng, prompt_ids, sp, seed: int, on_token, top: int | None = None,
             logprobs: list | None = None, presence: float = 0.0, frequency: float = 0.0):
  """The tokens; with `top` (0-5), each token's (lp, [(id, lp)] of the top best) is
  appended to `logprobs` before `on_token` sees it (which may end the loop by raising)."""
  penalized = presence != 0 or frequency != 0
  if top is None and not penalized:
    return eng.generate(prompt_ids, sp, seed=seed, on_token=on_token)
  t = len(prompt_ids)
  if t + sp.max_new_tokens > eng.max_len:
    raise ValueError(f"prompt ({t}) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                     f"max_len={eng.max_len}")
  key = jax.random.PRNGKey(seed)
  logits = eng.prefill(prompt_ids)
  out: list[int] = []
  if sp.max_new_tokens == 0:
    return out
  counts = jnp.zeros((np.shape(logits)[-1],), jnp.int32) if penalized else None
  temperature, top_p = float(sp.temperature), float(sp.top_p)
  with cpu_kernel.decoding():
    for i in range(sp.max_new_tokens):
      key, sub = jax.random.split(key)
      if penalized:
        tid, counts = next_token_penalized(logits, counts, sub, np.float32(presence),
                                           np.float32(frequency), temperature, top_p)
      else:
        tid = next_token(logits, sub, temperature, top_p)
      tid = int(tid)
      out.append(tid)
      if top is not None:
        logprobs.append(token_logprob(logits, tid, top))
      on_token(tid)        # may end the loop (stop text, cancel, timeout): raises
      if tid in sp.stop_ids or i == sp.max_new_tokens - 1:
        break
      logits = eng.decode_step(tid)
  return out
