"""A request's tokens from the engine: `OffloadEngine.generate` as it is, or, when the
request asks for log-probabilities or penalties, the same per-token loop with them.

    lps = []                     # (lp, [(id, lp)] of the top best) per token, as they come
    tokens = generate(eng, ids, sp, seed, on_token, top=1, logprobs=lps, presence=0.5)

The loop is `sampler.token_loop` with its own `pick`: the same key schedule and `next_token`, each next
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

from moejax.model.sampler import next_token, next_token_penalized, token_loop
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
  logits = eng.prefill(prompt_ids)
  if sp.max_new_tokens == 0:
    return []
  state = {"counts": jnp.zeros((np.shape(logits)[-1],), jnp.int32) if penalized else None}
  temperature, top_p = float(sp.temperature), float(sp.top_p)

  def pick(logits_V, key):
    if penalized:
      tid, state["counts"] = next_token_penalized(logits_V, state["counts"], key,
                                                  np.float32(presence), np.float32(frequency),
                                                  temperature, top_p)
    else:
      tid = next_token(logits_V, key, temperature, top_p)
    tid = int(tid)
    if top is not None:            # before `on_token` sees the token
      logprobs.append(token_logprob(logits_V, tid, top))
    return tid
  return token_loop(logits, lambda tid, i: eng.decode_step(tid), sp, jax.random.PRNGKey(seed),
                    on_token, pick)
