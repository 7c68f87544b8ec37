"""Generation with every expert resident: prefill, a jitted one-token decode step, sampling.

The KV cache is threaded explicitly and donated to the decode step.  Prompts are
padded on the right to a power-of-two bucket for prefill (padding only writes
cache rows at positions that are masked and later overwritten).

Two ways to decode after the prefill: `Sampler.generate` steps one token per call (for
callers that need each token as it comes, e.g. streaming); `Sampler.generate_loop` runs
every token in one jitted `lax.while_loop` on the device (`decode_loop`), with the same
key schedule, so the same seed gives the same tokens.  Both run inside
`cpu_kernel.decoding()` (the CPU kernel's helper threads spin between calls only there);
a caller that loops over `decode_step` itself enters it around its loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_kernel
from moejax.model import families
from moejax.model.config import ModelConfig
from moejax.model.model import Transformer, init_cache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0      # 0 = greedy
  top_p: float = 1.0
  max_new_tokens: int = 32
  stop_ids: tuple[int, ...] = ()
  # teacher forcing: the first len(forced_ids) tokens are these, not sampled (the logits
  # are computed as ever): scoring a given text, or every engine decoding one token stream
  forced_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 0:
      raise ValueError(f"--max_new_tokens must be >= 0, got {self.max_new_tokens}")
    if any(t < 0 for t in self.forced_ids):
      raise ValueError("forced_ids must be token ids (>= 0)")

  def forced(self, bucket_new: int) -> np.ndarray:
    """forced_ids as a loop's input [bucket_new] int32, -1 where a token is sampled."""
    out = np.full((bucket_new,), -1, np.int32)
    n = min(len(self.forced_ids), bucket_new)
    out[:n] = self.forced_ids[:n]
    return out


def sample_token(logits_BxV, key, temperature: float, top_p: float):
  """Greedy when temperature == 0, else temperature + nucleus (top-p) sampling."""
  return _sample(logits_BxV, key, temperature, top_p, greedy=temperature == 0.0,
                 nucleus=top_p < 1.0)


def _sample(logits_BxV, key, temperature, top_p, *, greedy: bool, nucleus: bool):
  """`sample_token` with the branches chosen by static flags, so that `temperature` and
  `top_p` may be traced scalars (the device loop) as well as Python floats."""
  if greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV.astype(jnp.float32) / temperature
  if nucleus:
    srt = jnp.sort(logits, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
    # smallest set whose mass reaches top_p: keep a token if the mass before it < top_p
    keep = (cum - jax.nn.softmax(srt, axis=-1)) < top_p
    cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(2, 3))
def next_token(logits_V, key, temperature: float, top_p: float):
  """`sample_token` for one sequence's logits [V] (device or numpy) in one dispatch:
  -> an int32 scalar on the device, fit to feed a lazy engine step.  (Eager, the same
  few ops cost ~0.2 ms a token on a CPU backend.)"""
  return sample_token(jnp.asarray(logits_V)[None], key, temperature, top_p)[0]


@functools.partial(jax.jit, static_argnums=(5, 6))
def next_token_penalized(logits_V, counts_V, key, presence, frequency, temperature: float,
                         top_p: float):
  """`next_token` after OpenAI's penalties over `counts_V` (int32 [V], how often each
  token was generated so far): logits - presence * (count > 0) - frequency * count.
  -> (the token, counts_V with it counted), both on the device."""
  counts = counts_V.astype(jnp.float32)
  logits = (jnp.asarray(logits_V).astype(jnp.float32) - presence * (counts > 0)
            - frequency * counts)
  tok = sample_token(logits[None], key, temperature, top_p)[0]
  return tok, counts_V.at[tok].add(1)


def bucket(n: int, minimum: int = 16) -> int:
  b = minimum
  while b < n:
    b *= 2
  return b


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def prefill_logits(model: Transformer, params, experts, cache, tokens_BxT, last):
  """The prompt through the model: (logits [B, V] at position `last` only, cache).

  The LM head runs on one position: over a whole prompt it costs more than the layers."""
  valid_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]) <= last, tokens_BxT.shape)
  x_BxTxD, cache, _ = model.apply({"params": params}, tokens_BxT, experts, cache, 0,
                                  valid_BxT=valid_BxT, method=Transformer.hidden)
  x_Bx1xD = jax.lax.dynamic_slice_in_dim(x_BxTxD, last, 1, axis=1)
  return model.apply({"params": params}, x_Bx1xD, method=Transformer.logits)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def decode_logits(model: Transformer, params, experts, cache, token_B, end_index):
  """One token of each row at `end_index` (one, or [B]: a position per row) -> (its
  logits [B, V], cache): for callers that sample on the host (the server's batch)."""
  logits, cache, _ = model.apply({"params": params}, token_B[:, None], experts, cache, end_index)
  return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("model", "temperature", "top_p"),
                   donate_argnames=("cache",))
def decode_sample(model: Transformer, params, experts, cache, token_B, end_index, key, *,
                temperature: float, top_p: float):
  """One token at `end_index`: (sampled next token [B], its logits [B, V], cache)."""
  logits, cache, _ = model.apply({"params": params}, token_B[:, None], experts, cache, end_index)
  nxt = sample_token(logits[:, -1], key, temperature, top_p)
  return nxt, logits[:, -1], cache


class _LoopCarry(NamedTuple):
  """`sample_loop`'s while-loop carry: the next token's index i, whether to stop, the key,
  the step's carry, the last token, the tokens [bucket_new] and records so far."""
  i: jax.Array
  done: jax.Array
  key: jax.Array
  carry: Any
  tok: jax.Array
  toks: jax.Array
  recs: Any


def sample_loop(step, carry, logits_V, start, key, n_new, stop_ids, temperature, top_p, *,
                bucket_new: int, greedy: bool, nucleus: bool, record=None, forced=None):
  """The one device generation loop (gemma's sampler shape), for the Sampler and the
  engine: up to `n_new` tokens of one sequence in one `lax.while_loop`.

  step(carry, token, pos) -> (carry, logits [V], rec): one decoded token.  The first
  token is sampled from `logits_V` (the prompt's); token i (i >= 1) is sampled from the
  decode of token i-1 at position `start + i - 1`.  Stops after `n_new` tokens or after
  a token in `stop_ids` (-1 pads; the stop token is kept).  Keys: one split of `key` per
  token, the token sampled with the split-off half (as `token_loop`).  `n_new`,
  `temperature` and `top_p` may be traced; static: the buffer length `bucket_new`
  (>= max(n_new, 1)), `greedy` / `nucleus` (temperature == 0, top_p < 1), and `record`
  (the shape of step's rec, e.g. from `jax.eval_shape`; None: step returns none).
  `forced` [bucket_new] int32 (`SamplingParams.forced`): token i is forced[i] where that
  is >= 0, not sampled (teacher forcing).
  -> (carry, tokens [bucket_new] int32 (-1 after the end), count (int32 scalar), recs
  [bucket_new, ...]: row i is the decode of token i, rows from count - 1 on unused)."""
  def sample(lg, k, i):
    tok = _sample(lg[None], k, temperature, top_p, greedy=greedy, nucleus=nucleus)[0]
    return tok if forced is None else jnp.where(forced[i] >= 0, forced[i], tok)
  key, sub = jax.random.split(key)
  tok = sample(logits_V, sub, 0)
  toks = jnp.full((bucket_new,), -1, jnp.int32).at[0].set(tok)
  recs = jax.tree_util.tree_map(lambda r: jnp.zeros((bucket_new,) + r.shape, r.dtype), record)

  def body(c: _LoopCarry) -> _LoopCarry:
    i = c.i
    carry, logits, rec = step(c.carry, c.tok, start + i - 1)
    recs = jax.tree_util.tree_map(lambda a, r: a.at[i - 1].set(r), c.recs, rec)
    key, sub = jax.random.split(c.key)
    tok = sample(logits, sub, i)
    return _LoopCarry(i + 1, jnp.any(tok == stop_ids) | (i + 1 >= n_new), key, carry, tok,
                      c.toks.at[i].set(tok), recs)

  done = jnp.any(tok == stop_ids) | (n_new <= 1)
  out = jax.lax.while_loop(lambda c: ~c.done, body,
                           _LoopCarry(jnp.int32(1), done, key, carry, tok, toks, recs))
  return out.carry, out.toks, jnp.minimum(out.i, n_new), out.recs


def token_loop(logits_V, decode, sp: SamplingParams, key, on_token=None, pick=None) -> list[int]:
  """The one per-token generation loop (the Sampler's, the engine's and the server's, for
  callers that take each token as it comes): token i is sampled from the last logits with
  the next split of `key` (as `sample_loop`), then `decode(token, i)` gives the next
  logits.  pick(logits, key) -> token id replaces `next_token` (the server's penalties and
  log-probabilities).  Greedy (temperature 0) reads no key: none is split (a dispatch a
  token).  Runs inside `cpu_kernel.decoding()`."""
  if pick is None:
    pick = lambda lg, k: int(next_token(lg, k, float(sp.temperature), float(sp.top_p)))
  out = []
  with cpu_kernel.decoding():
    for i in range(sp.max_new_tokens):
      if sp.temperature > 0:
        key, sub = jax.random.split(key)
      else:
        sub = key
      tid = sp.forced_ids[i] if i < len(sp.forced_ids) else pick(logits_V, sub)
      out.append(tid)
      if on_token:
        on_token(tid)
      if tid in sp.stop_ids or i == sp.max_new_tokens - 1:
        break
      logits_V = decode(tid, i)
  return out


@functools.partial(jax.jit, static_argnames=("model", "bucket_new", "greedy", "nucleus"),
                   donate_argnames=("cache",))
def decode_loop(model: Transformer, params, experts, cache, logits_1xV, start, key, n_new,
                stop_ids, temperature, top_p, forced, *, bucket_new: int, greedy: bool,
                nucleus: bool):
  """`sample_loop` over the resident model -> (tokens [bucket_new], count, cache)."""
  def step(cache, tok, pos):
    logits, cache, _ = model.apply({"params": params}, tok.reshape(1, 1), experts, cache, pos)
    return cache, logits[0, -1], None
  cache, out, n, _ = sample_loop(step, cache, logits_1xV[0], start, key, n_new, stop_ids,
                                 temperature, top_p, bucket_new=bucket_new, greedy=greedy,
                                 nucleus=nucleus, forced=forced)
  return out, n, cache


class Sampler:
  """Fully resident generation for a loaded model (params + device expert weights).

  The jitted steps are module functions keyed on the (hashable) Flax module; params,
  experts and cache go in as arguments, so no compile cache keeps a Sampler's
  arrays alive after it is dropped.
  """

  def __init__(self, cfg: ModelConfig, params, experts, max_len: int = 1024,
               dtype=jnp.float32):
    self.cfg, self.params, self.experts = cfg, params, experts
    self.max_len = max_len
    self.dtype = dtype
    self.model = Transformer(cfg, dtype)

  def prefill(self, prompt_BxT: np.ndarray, fit: bool = False):
    """Returns (last-position logits [B, V], cache); fit: a cache of the prompt's bucket,
    not of max_len (for `model.put_row` into a batch's longer cache)."""
    b, t = prompt_BxT.shape
    if t + 1 > self.max_len:
      raise ValueError(f"prompt of {t} tokens does not fit max_len={self.max_len}")
    # A recurrent (DeltaNet) state would absorb padding tokens: prefill those models unpadded.
    tb = t if families.of(self.cfg).has_recurrent_state(self.cfg) else min(bucket(t), self.max_len)
    padded = np.zeros((b, tb), np.int32)
    padded[:, :t] = prompt_BxT
    cache = init_cache(self.cfg, b, tb if fit else self.max_len, self.dtype)
    return prefill_logits(self.model, self.params, self.experts, cache, jnp.asarray(padded),
                          np.int32(t - 1))

  def decode_step(self, cache, token_B, end_index, sp: SamplingParams, key):
    """One token of each row -> (next tokens [B], their logits [B, V], cache).  end_index:
    the position of the batch, or [B]: each row at its own (a batch of sequences decoded
    together, each joined by `model.put_row` after its own prompt pass; a free row decodes
    at position 0 and is overwritten when a sequence joins it).  Row b's tokens are those
    it gets decoded alone, to float rounding."""
    # numpy, not jnp: a jnp scalar is one more XLA call per token (~0.2 ms here)
    return decode_sample(self.model, self.params, self.experts, cache, token_B,
                         np.asarray(end_index, np.int32), key,
                         temperature=float(sp.temperature), top_p=float(sp.top_p))

  def decode_loop(self, cache, logits_1xV, start: int, sp: SamplingParams, key):
    """`decode_loop` after a batch-1 `prefill` of `start` tokens (the cache is donated):
    (tokens [bucket] int32, count, cache) on the device; the tokens are tokens[:count].
    Returns once the loop has run (inside `cpu_kernel.decoding()`)."""
    if logits_1xV.shape[0] != 1:
      raise ValueError(f"decode_loop runs one sequence, got a batch of {logits_1xV.shape[0]}")
    stop = np.full(bucket(len(sp.stop_ids), 4), -1, np.int32)
    stop[:len(sp.stop_ids)] = sp.stop_ids
    bucket_new = bucket(max(sp.max_new_tokens, 1))
    with cpu_kernel.decoding():
      return jax.block_until_ready(decode_loop(
          self.model, self.params, self.experts, cache, logits_1xV, np.int32(start), key,
          np.int32(sp.max_new_tokens), stop, np.float32(sp.temperature),
          np.float32(sp.top_p), sp.forced(bucket_new), bucket_new=bucket_new,
          greedy=sp.temperature == 0.0, nucleus=sp.top_p < 1.0))

  def generate_loop(self, prompt_ids: list[int], sp: SamplingParams, seed: int = 0) -> list[int]:
    """`generate` with every token in one device loop (no host work per token): the same
    tokens for the same seed.  Compiled once per (max_new_tokens bucket, greedy, top_p < 1,
    stop-id bucket); prompts of one prefill bucket share the prefill's compilation."""
    prompt = self._prompt(prompt_ids, sp)
    logits, cache = self.prefill(prompt)
    out, n, _ = self.decode_loop(cache, logits, prompt.shape[1], sp, jax.random.PRNGKey(seed))
    return np.asarray(out)[:int(n)].tolist()

  def _prompt(self, prompt_ids: list[int], sp: SamplingParams) -> np.ndarray:
    prompt = np.asarray([prompt_ids], np.int32)
    t = prompt.shape[1]
    if t + sp.max_new_tokens > self.max_len:
      raise ValueError(f"prompt ({t}) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                       f"max_len={self.max_len}")
    return prompt

  def generate(self, prompt_ids: list[int], sp: SamplingParams, seed: int = 0,
               on_token=None) -> list[int]:
    """Generates up to sp.max_new_tokens tokens after `prompt_ids` (batch 1), one call
    per token (`token_loop`: `on_token(id)` as each comes); `generate_loop` runs them on
    the device, with the same tokens for the same seed."""
    prompt = self._prompt(prompt_ids, sp)
    t = prompt.shape[1]
    logits, cache = self.prefill(prompt)
    state = {"cache": cache}

    def decode(tid, i):
      _, lg, state["cache"] = decode_sample(
          self.model, self.params, self.experts, state["cache"], np.asarray([tid], np.int32),
          np.int32(t + i), _NO_KEY, temperature=0.0, top_p=1.0)
      return lg[0]
    return token_loop(logits[0], decode, sp, jax.random.PRNGKey(seed), on_token)


_NO_KEY = np.zeros((2,), np.uint32)   # a raw key: greedy steps of `token_loop` draw nothing
