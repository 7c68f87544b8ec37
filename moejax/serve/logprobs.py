"""Log-probabilities: the prompt's (exact, teacher-forced, every expert), a generated
token's (from the logits its decode step produced), and OpenAI's two response formats.

    scorer = PromptScorer(cfg, params, store, dtype)
    prompt = scorer(ids, top=1)        # [None, (lp, [(id, lp), ...]), ...] one per token
    gen = token_logprob(logits_V, tid, top=1)       # (lp, [(id, lp), ...])
    completion_logprobs(tok, ids, entries, start)   # {tokens, token_logprobs, ...}
    chat_logprobs(tok, ids, entries)                # {content: [{token, logprob, ...}]}

The prompt pass runs the model's own `Transformer` layer by layer with every expert of a
layer copied from the host store for that layer alone (`store.stacked`), so the device
holds one layer's experts at a time, as the engine's exact prompt pass does, and the
answer does not depend on the offload policy or on what the cache holds: an evaluation
score (lm-evaluation-harness's log-likelihood tasks) is the model's.  Each layer is its
own compiled program per prompt bucket (its mixer may differ); they compile on a
request's first use of a bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.model import Transformer
from moejax.model.sampler import bucket

MAX_TOP = 5          # top_logprobs (chat) and logprobs (completions) at most


@functools.partial(jax.jit, static_argnames=("model",))
def _embed(model, params, tokens_1xT):
  return model.apply({"params": params}, tokens_1xT, method=Transformer.embed)


@functools.partial(jax.jit, static_argnames=("model", "i"))
def _layer(model, i, params, x_1xTxD, experts):
  def run(m, x):
    t = x.shape[1]
    y, _, _ = m.layers[i](x, jnp.arange(t)[None], None, 0, experts)
    return y
  return model.apply({"params": params}, x_1xTxD, method=run)


@functools.partial(jax.jit, static_argnames=("model", "top"))
def _head(model, params, x_1xTxD, tokens_1xT, top: int):
  """Per position p: log p(token p+1 | tokens <= p) and the `top` best (ids, log-probs)."""
  logits = model.apply({"params": params}, x_1xTxD, method=Transformer.logits)[0]
  lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nxt = jnp.concatenate([tokens_1xT[0, 1:], jnp.zeros((1,), jnp.int32)])
  lp = jnp.take_along_axis(lsm, nxt[:, None], axis=-1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(lsm, top)
  return lp, top_ids, top_lp


@functools.partial(jax.jit, static_argnames=("top",))
def _token(logits_V, tid, top: int):
  lsm = jax.nn.log_softmax(jnp.asarray(logits_V).astype(jnp.float32))
  top_lp, top_ids = jax.lax.top_k(lsm, top)
  return lsm[tid], top_ids, top_lp


def token_logprob(logits_V, tid: int, top: int):
  """A generated token's (log-prob, [(id, log-prob)] of the `top` best) under `logits_V`
  (the raw logits its step produced: before penalties, temperature and top_p)."""
  lp, ids, lps = jax.device_get(_token(logits_V, np.int32(tid), max(top, 1)))
  return float(lp), [(int(a), float(b)) for a, b in zip(ids[:top], lps[:top])]


class PromptScorer:
  """The prompt's log-probabilities with every expert (the resident model's answer)."""

  def __init__(self, cfg, params, store, dtype):
    self.cfg, self.params, self.store = cfg, params, store
    self.dtype = jnp.dtype(dtype)
    self.model = Transformer(cfg, dtype)

  def _layer_params(self, i):
    """The parameters with layer i's as the model reads them: an engine whose layers run as
    one scan holds them stacked [L, ...] under "layers" (`decode.stack_params`): layer i is
    sliced out for this call only."""
    if "layers" not in self.params:
      return self.params
    rest = {k: v for k, v in self.params.items() if k != "layers"}
    return dict(rest, **{f"layers_{i}": jax.tree_util.tree_map(lambda a: a[i],
                                                                self.params["layers"])})

  def _experts(self, i):
    if i not in self.store.layers:
      return None
    return {k: jnp.asarray(np.asarray(v), dtype=self.dtype if jnp.issubdtype(v.dtype,
                                                                             jnp.floating)
                           else v.dtype) for k, v in self.store.stacked(i).items()}

  def __call__(self, ids: list[int], top: int) -> list:
    """[None, then per token p >= 1: (log p(ids[p] | ids[:p]), [(id, lp)] top best)]."""
    t = len(ids)
    tb = bucket(t)            # causal, no cache: the padding after the prompt is never seen
    toks = np.zeros((1, tb), np.int32)
    toks[0, :t] = ids
    x = _embed(self.model, self.params, toks)
    for i in range(self.cfg.num_layers):
      x = _layer(self.model, i, self._layer_params(i), x, self._experts(i))
    lp, top_ids, top_lp = jax.device_get(_head(self.model, self.params, x, jnp.asarray(toks),
                                               max(top, 1)))
    out = [None]
    for p in range(1, t):
      out.append((float(lp[p - 1]), [(int(a), float(b)) for a, b in
                                     zip(top_ids[p - 1, :top], top_lp[p - 1, :top])]))
    return out


def offsets(tok, ids: list[int], start: int = 0) -> list[int]:
  """Each token's character offset in the decoded text of `ids` (+ start): a token's text
  is what it adds to the decode of the few tokens before it (a space a tokenizer puts
  before a word, a character split over tokens)."""
  out, pos = [], start
  for i in range(len(ids)):
    out.append(pos)
    window = ids[max(0, i - 4):i + 1]
    pos += len(tok.decode(window)) - len(tok.decode(window[:-1]))
  return out


def completion_logprobs(tok, ids: list[int], entries: list, start: int = 0) -> dict:
  """/v1/completions' `logprobs` for tokens `ids` with entries None or (lp, top)."""
  names = [tok.decode([i]) for i in ids]
  top = [None if e is None else {tok.decode([a]): b for a, b in e[1]} for e in entries]
  return {"tokens": names, "token_logprobs": [None if e is None else e[0] for e in entries],
          "top_logprobs": top, "text_offset": offsets(tok, ids, start)}


def _entry(tok, tid: int, lp: float) -> dict:
  s = tok.decode([tid])
  return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tok, ids: list[int], entries: list) -> dict:
  """/v1/chat/completions' `logprobs` for the generated tokens `ids`."""
  return {"content": [dict(_entry(tok, i, e[0]), top_logprobs=[_entry(tok, a, b)
                                                               for a, b in e[1]])
                      for i, e in zip(ids, entries)]}
