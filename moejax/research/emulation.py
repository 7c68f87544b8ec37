"""What the exact emulator's streams share, decoded one at a time (`research.emulator`)
or B together sharing every layer's cache (`research.shared_batch`): the static `Setup`
(a jit key), the built `Emulation`, a stream's exact prompt, and the chunked decode of
the tokens after the prompts that both run.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import resident as resident_lib
from moejax.cache.policy import PolicyParams
from moejax.cache.step import STATS
from moejax.offload import decode as decode_lib
from moejax.offload import prompt as prompt_lib


class EmulatorError(ValueError):
  """Bad emulator input; the message names the flag or argument."""


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about an emulation (hashable: a static jit argument)."""
  ctx: decode_lib.Ctx             # a layer's step (`Ctx.make`, source "table")
  num_slots: int                 # physical slots per MoE layer (budget + staging)
  max_len: int                   # KV cache length (attention window)
  dtype: str = "float32"
  detail: bool = False           # also return per-layer actions, resident sets, logits
  batch: int = 1                 # streams sharing one cache, decoded together (`shared_batch`)

  cfg = property(lambda self: self.ctx.cfg)
  policy = property(lambda self: self.ctx.policy)


@dataclasses.dataclass
class Emulation:
  """What an emulation needs besides the tokens: built once per (model, policy, budget)."""
  setup: Setup
  params: dict          # the model's parameters (embedding, head, norms)
  layers: object        # the decoder layers' parameters (see `layer_stack.stack_layers`)
  table: object         # per layer {"table": its experts on the device, + predictors}
  states: object        # the initial ResidentStates (stacked for uniform models)
  budget: resident_lib.Budget


def prefill_setup(setup: Setup) -> Setup:
  """The prefill reads only the eviction rule and the LFU decay: one compile serves
  every policy that shares them."""
  ctx = dataclasses.replace(setup.ctx, policy=PolicyParams(cache=setup.policy.cache),
                            control=None)
  return dataclasses.replace(setup, ctx=ctx, detail=False)


def prefill_one(setup: Setup, params, layers, table, states, tokens_P, length, decay_pow):
  """Exact prompt (first `length` of tokens_P) of one stream, as OffloadEngine.prefill."""
  logits, carry, _ = prompt_lib.prompt_pass(setup.ctx, jnp.dtype(setup.dtype), setup.max_len,
                                            params, layers, table, states, tokens_P, length,
                                            decay_pow, scan=True)
  return logits, carry


def decode_chunks(program, em: Emulation, carry, inputs, logits_NxV, targets_NxT, chunk: int,
                  on_chunk, unpack=lambda out: out) -> dict:
  """The decoded tokens 1..T-1 of N streams after their prompts (logits_NxV), by the jitted
  `program(setup, params, layers, table, carry, *inputs(at, c))` over `chunk` tokens a call
  (compiled once; `unpack` makes a call's output per stream) -> `run_streams`'s dict."""
  n, t = targets_NxT.shape
  first = -np.asarray(jax.nn.log_softmax(logits_NxV))[np.arange(n), targets_NxT[:, 0]]
  c = chunk or (t - 1)
  if (t - 1) % max(c, 1):
    raise EmulatorError(f"T - 1 = {t - 1} decoded tokens is not a multiple of chunk={c}")
  outs, compile_s, run_s, step = [], 0.0, 0.0, None
  for at in range(1, t, max(c, 1)):
    args = (em.params, em.layers, em.table, carry) + inputs(at, c)
    if step is None:
      t0 = time.perf_counter()
      step = program.lower(em.setup, *args).compile()
      compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry, out = step(*args)
    outs.append(unpack(jax.device_get(out)))
    run_s += time.perf_counter() - t0
    if on_chunk is not None:
      on_chunk(n * c)
  out = {k: np.concatenate([o[k] for o in outs], axis=1) for k in outs[0]} if outs else {
      "nll": np.zeros((n, 0), np.float32),
      "stats": np.zeros((n, 0, len(STATS)), np.float32)}
  out["nll"] = np.concatenate([first[:, None], out["nll"]], axis=1)
  out["first_logits"] = np.asarray(logits_NxV)
  out["compile_s"], out["run_s"] = compile_s, run_s
  return out

