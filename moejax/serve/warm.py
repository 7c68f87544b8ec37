"""What a server's first requests run, compiled before it says ready.

The fault (issue 62): under load the first batch after "ready" took 5.6 s a request
against 0.7 s for later ones.  The start-up compiled the decode step and some prompt
buckets, and the first requests then compiled, one after the other on the engine's
thread while the rest of the batch waited: the sampler (`next_token` for their
temperature and top_p, the PRNG key and its split, 0.4-1.1 s together on an idle 2-core
CPU), a joining prompt's KV-cache write into its row (`put_row`, per bucket), and the
prompt pass of a bucket beyond the warmed ones (1.1-2.2 s each on the demo, whatever its
length; the decode step 2.0 s at batch 1, 3.8 s at batch 8).

  lengths = warm.prompt_lengths(["all"], max_len)     # one length per bucket
  warm.sampling(vocab)                                # greedy and OpenAI's default sampling
  warm.joins(engine, max_batch, lengths)              # put_row for each bucket (batches)
  warm.policies(engine, policy, ["speed"], lengths)   # --warm_policies
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from moejax.model.model import put_row
from moejax.model.sampler import bucket, next_token

# (temperature, top_p) compiled at start-up: greedy, and OpenAI's defaults (temperature 1,
# top_p 1), which the openai client sends when a request sets neither.  `next_token` is
# compiled per value (they are static), so another value compiles on its first use.
SAMPLING = ((0.0, 1.0), (1.0, 1.0))


def prompt_lengths(values, max_len: int) -> list[int]:
  """--warm_prompt_tokens -> the prompt lengths whose pass is compiled at start-up:
  "all" gives one length in each bucket up to max_len (16, 32, ... and max_len - 1:
  every prompt a request may send); else the integers below max_len.  ValueError names
  a value that is neither."""
  out = []
  for v in values:
    v = str(v).strip()
    if v == "all":
      b = bucket(1)
      while b < max_len - 1:
        out.append(b)
        b *= 2
      out.append(max_len - 1)
    elif v.isdigit():
      out.append(int(v))
    else:
      raise ValueError(f"{v!r} is not a prompt length (an integer) or 'all'")
  return sorted({n for n in out if 1 <= n < max_len})


def sampling(vocab: int) -> None:
  """Compiles (by running on zeros) what a request's tokens are picked with: the PRNG key
  of its seed and its split, and `next_token` for each of SAMPLING."""
  key = jax.random.PRNGKey(0)
  key, sub = jax.random.split(key)
  logits = np.zeros((vocab,), np.float32)
  for temperature, top_p in SAMPLING:
    jax.block_until_ready(next_token(logits, sub, temperature, top_p))


def joins(engine, max_batch: int, lengths) -> None:
  """Compiles (runs nothing) the write of a joining prompt's KV cache, sized to its
  bucket, into a row of the batch's cache (`Batched.prompt`'s `put_row`) for each of
  `lengths`' buckets.  engine: the `OffloadEngine` the batch decodes on."""
  from moejax.offload import decode, prompt
  prog, dtype = engine.program, engine.dtype
  # placed as the calls' arrays are (on the engine's device): a program compiled for
  # unplaced arguments is not the one a call with placed arrays looks up
  on = jax.sharding.SingleDeviceSharding(engine.device)

  def cache(rows: int, length: int):
    shapes = jax.eval_shape(lambda: decode.empty_carry(prog.ctx, dtype, length, {},
                                                       scan=prog.scan, rows=rows).cache)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), shapes)
  batch = cache(max_batch, engine.max_len)
  axis = 1 if prog.scan else 0
  for p in prompt.buckets(prog, lengths):
    put_row.lower(batch, cache(1, p), np.int32(0), axis).compile()


def policies(engine, default, names, lengths) -> tuple:
  """Compiles the policies `names` (--warm_policies) on `engine`, an OffloadEngine or a
  batch (`batching.Offloaded`, which compiles a policy on `use_policy`), then goes back to
  `default`; the resident experts stay -> the policies compiled."""
  from moejax.cache.policy import make_policy
  batch = hasattr(engine, "use_policy")
  out = []
  for name in names:
    p = make_policy(name)
    if p == default or p in out:
      continue
    t = time.time()
    if batch:
      engine.use_policy(p)
    else:
      engine.set_policy(p)
      engine.warmup(prompt_lengths=lengths)
    print(f"[moejax] compiled {p.describe()} in {time.time() - t:.1f} s", file=sys.stderr)
    out.append(p)
  if out and batch:
    engine.use_policy(default)
  elif out:
    engine.set_policy(default)
  return tuple(out)
