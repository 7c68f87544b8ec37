"""The exact emulator with B streams sharing every MoE layer's cache: a batch decoded
together, as the engine's `offload.batch.Batched` decodes one (`emulator.make(batch=B)`,
which runs its streams here; the parts both share are `research.emulation`).

Streams are taken B at a time (the stream count a multiple of B).  In a group, each
stream's first token is a one-token prompt, run one after another into the shared states
(as requests join the engine's batch: `offload.prompt.prompt_pass`); then each token
position of the group's B streams is ONE decoded step of B rows
(`offload.decode.decode_token` with B rows: per MoE layer one batched cache step), teacher
forced.  Groups are independent (vmapped).  Per stream, the statistics of its row of each
step (`cache.counting.row_counts`: its own expert calls; the step's admissions and
evictions shared by the B rows).  B = 1 is the plain emulator's streams, decision for
decision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import step as step_lib
from moejax.model import layer_stack
from moejax.offload import batch as batch_lib
from moejax.offload import decode as decode_lib
from moejax.research import emulation as E


def _prompts(setup, params, layers, table, states, tokens_B, decay):
  """One group's one-token prompts, one after another into the shared states -> (logits
  [B, V], the group's carry: a B-row cache, the states, nothing pending)."""
  ps = E.prefill_setup(setup)

  def one(st, tok):
    logits, carry = E.prefill_one(ps, params, layers, table, st, tok[None], jnp.int32(1),
                                  decay)
    return carry.states, (logits, carry.cache)
  states, (logits, caches) = jax.lax.scan(one, states, tokens_B)
  like = jax.eval_shape(lambda: decode_lib.empty_carry(
      setup.ctx, jnp.dtype(setup.dtype), setup.max_len, {}, True, rows=tokens_B.shape[0]))
  pending = jax.tree_util.tree_map(lambda a: jnp.full(a.shape, -1, a.dtype), like.carried)
  return logits, layer_stack.Carry(batch_lib.stack_rows(caches, like.cache), states, pending)


@functools.partial(jax.jit, static_argnames=("setup",))
def prefill(setup, params, layers, table, states, tokens_GxB, decay):
  """Every group's prompts (each group from its own copy of `states`)."""
  one = functools.partial(_prompts, setup, params, layers, table, states, decay=decay)
  return jax.vmap(one)(tokens_GxB)


@functools.partial(jax.jit, static_argnames=("setup",), donate_argnums=(4,))
def teacher_forced(setup, params, layers, table, carry, tokens_GxBxT, pos_T, targets_GxBxT,
                   seed_G):
  """Feeds every group's B streams a token per step -> (carry, {"nll": [G, B, T],
  "stats": [G, B, T, len(STATS)]})."""

  def one(carry, toks, tgts, seed):
    base = jax.random.PRNGKey(seed)
    nb = toks.shape[0]

    def body(c, xs):
      tok, p, tgt, t = xs
      c, logits, rec = decode_lib.decode_token(
          setup.ctx, jnp.dtype(setup.dtype), params, layers, table, c, tok,
          jnp.full((nb,), p, jnp.int32), jax.random.fold_in(base, t), scan=True)
      nll = -jax.nn.log_softmax(logits)[jnp.arange(nb), tgt]
      stats = jnp.sum(step_lib.row_counts(jnp, rec, jnp.ones((nb,), bool)), axis=0)
      return c, dict(nll=nll, stats=stats)

    c, out = jax.lax.scan(body, carry, (toks.T, pos_T, tgts.T, jnp.arange(toks.shape[1])))
    return c, {k: jnp.moveaxis(v, 0, 1) for k, v in out.items()}

  return jax.vmap(one)(carry, tokens_GxBxT, targets_GxBxT, seed_G)


def run_streams(em, tokens_NxT, pos_T, targets_NxT, seed: int, chunk: int, on_chunk):
  """`emulator.run_streams` of streams in groups of `em.setup.batch` sharing the cache
  (the inputs checked there) -> the same numpy dict, per stream."""
  b = em.setup.batch
  n = tokens_NxT.shape[0]
  if n % b:
    raise E.EmulatorError(f"{n} streams do not split into batches of {b}: use a stream count "
                          f"that is a multiple of --batch")
  g = n // b
  grp = lambda a: np.asarray(a).reshape((g, b) + np.shape(a)[1:])
  decay = np.float32(float(em.setup.policy.lfu_decay))
  logits, carry = prefill(em.setup, em.params, em.layers, em.table, em.states,
                          grp(tokens_NxT[:, 0]), decay)
  seeds = np.arange(g, dtype=np.int32) + 7919 * seed
  inputs = lambda at, c: (grp(tokens_NxT[:, at:at + c]), pos_T[at:at + c],
                          grp(targets_NxT[:, at:at + c]), seeds + at)
  unpack = lambda out: {k: np.asarray(v).reshape((n,) + v.shape[2:]) for k, v in out.items()}
  return E.decode_chunks(teacher_forced, em, carry, inputs, np.asarray(logits).reshape(n, -1),
                         targets_NxT, chunk, unpack=unpack, on_chunk=on_chunk)
