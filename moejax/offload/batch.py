"""Rows decoded together under an offload policy: up to B sequences, each at its own
position with its own KV-cache row, sharing every MoE layer's resident experts.

  b = engine.batched(8)                  # the engine's policy, budget, link and experts
  logits_V = b.prompt(prompt_ids, row=3)     # an exact prompt into row 3
  logits_BxV = b.step(tokens_B, valid_B)     # one token of every active row
  b.set_policy("speed")                      # between steps (validated as the engine's)

A step is the engine's own decode program over B rows (`decode.step_fn` with rows: one
compile per B, whatever the rows hold): per MoE layer ONE batched cache step
(`cache.step.policy_head` with the rows' routers): each (row, expert) is decided by the
policy on its own, the experts waited for are the union over the rows and each is
copied once, the substitutes are resident or fetched this step, usage and admission add
over the rows; then every row's experts run from the slot buffers.  A free row (valid
False) decodes at position 0, unread, and decides nothing.  Speculative prefetch predicts
one token's next layer: a batch runs without it.

A prompt runs alone, as `OffloadEngine.prefill` (exact; the missing experts it used
most are inserted into the shared cache), and its KV cache is written into its row.
An emulated link is charged per step for the step's copies and per prompt for its own.

Records (`records`): per active row of a step a `stats.TokenRecord`: its own experts'
actions (hits, fetches: the row that waited first for an expert has its FETCH), and the
step's wall time and waits, as that row's token experienced them; what belongs to the step
(admissions, evictions) is shared equally by its active rows, so sums over rows are the
step's.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import step as step_lib
from moejax.cache.policy import FETCH, FETCH_LOW
from moejax.model import layer_stack
from moejax.model.model import put_row
from moejax.offload import decode, prompt
from moejax.offload.stats import TokenRecord, from_counts, layer_records, link_counts

_PER_ROW = ("ids", "actions", "substitutes", "share", "rows", "true_ids")


class Batched:
  """B sequences decoded together on an engine's resident experts (module docstring);
  made by `OffloadEngine.batched`, which hands its states over."""

  def __init__(self, engine, states, max_batch: int):
    if max_batch < 1:
      raise ValueError(f"--max_batch must be >= 1, got {max_batch}")
    if engine.mode.on:
      raise ValueError(f"--prefetch={engine.mode.prefetch}: speculative prefetch predicts one "
                       "token's next layer; batched decoding (--max_batch > 1) runs without it")
    self.engine, self.max_batch = engine, max_batch
    self._steps: list[tuple] = []     # (numpy Record, valid [B], wall_s, waits) per step
    self.last_prompt_fetches: float | None = None    # experts the last prompt copied
    self._bytes = (engine.moe_layers, engine.store.expert_nbytes(), engine.low_nbytes)
    self._carry = layer_stack.Carry(None, states, None)
    self.record_layout = decode.record_layout(engine.program, states, rows=max_batch)
    self.reset()

  def reset(self):
    """Every row free: a new KV cache, nothing pending; the resident experts stay."""
    eng = self.engine
    if self._carry is None:
      raise RuntimeError("the batch's resident experts were lost in a failed step")
    self._carry = eng.new_carry(self._carry.states, rows=self.max_batch)
    self.pos = np.zeros(self.max_batch, np.int32)      # each row's next position

  @property
  def policy(self):
    return self.engine.policy

  def set_policy(self, policy):
    """Decodes from the next step under `policy` (`OffloadEngine.set_policy`: the same
    checks, the resident sets kept)."""
    self.engine.set_policy(policy)
    self.record_layout = decode.record_layout(self.engine.program, self.states,
                                              rows=self.max_batch)

  @property
  def states(self):
    """The shared per-MoE-layer ResidentStates, as the engine's programs take them."""
    return self._carry.states

  def resident_sets(self) -> dict[int, list[int]]:
    """{MoE layer: resident experts} after the last step or prompt."""
    eng = self.engine
    return {l: s.resident_experts()
            for l, s in decode.per_layer(eng.program, eng.moe_layers, self.states).items()}

  @property
  def records(self) -> list[TokenRecord]:
    """Per active row of each step since the last `take_records`, in order (rows by
    index), with their per-layer decisions (`stats.LayerRecord`)."""
    return [r for st in self._steps for r in row_records(*st, self._bytes, layers=True)]

  def take_records(self, layers: bool = True) -> list[TokenRecord]:
    """`records`, handed over and forgotten; layers=False: counts and times only (a
    server's per-request figures: no per-layer id lists to build)."""
    steps, self._steps = self._steps, []
    return [r for st in steps for r in row_records(*st, self._bytes, layers=layers)]

  # -------------------------------------------------------------- programs
  def warmup(self, prompt_lengths=()):
    """Compiles the B-row step and the prompt pass of each length's bucket (nothing runs)."""
    eng = self.engine
    zeros = np.zeros(self.max_batch, np.int32)
    decode.step_fn(eng.program).lower(eng.params, eng.sources, self._carry, zeros, zeros,
                                      zeros.astype(bool)).compile()
    prompt.compile_prompts(eng.program, eng.params, eng.sources, self.states, prompt_lengths,
                           fit=True)

  def prompt(self, prompt_ids, row: int) -> np.ndarray:
    """The exact prompt of the sequence that joins at `row` -> its last logits [V]; its
    experts enter the shared cache as `OffloadEngine.prefill`'s do."""
    eng = self.engine
    t = len(prompt_ids)
    if not 0 <= row < self.max_batch:
      raise ValueError(f"row {row} is not in a batch of {self.max_batch}")
    if t < 1 or t + 1 > eng.max_len:
      raise ValueError(f"a prompt of {t} tokens does not fit max_len={eng.max_len}")
    t0 = time.perf_counter()
    toks = np.zeros((prompt.prompt_bucket(eng.program, t),), np.int32)
    toks[:t] = prompt_ids
    carry, self._carry = self._carry, None
    decay = np.float32(float(eng.policy.lfu_decay) ** np.float64(t))
    logits, joined, did = prompt.prefill(
        prompt.fitted(eng.program, len(toks)), eng.params, eng.sources, carry.states, toks,
        np.int32(t), decay)
    self._carry = layer_stack.Carry(
        put_row(carry.cache, joined.cache, np.int32(row), 1 if eng.program.scan else 0),
        joined.states, carry.carried)
    self.pos[row] = t
    out, copied = jax.device_get((logits, did.copied_E))
    n_l = np.sum(np.asarray(copied) >= 0, axis=-1)      # experts copied per MoE layer
    self.last_prompt_fetches = float(np.sum(n_l))
    if eng.link.emulated:
      eng.charge_link(t0, f"the {t}-token prompt of row {row}", n_l, 0 * n_l, 0 * n_l)
    return np.asarray(out)

  def step(self, tokens_B, valid_B) -> np.ndarray:
    """One token of every active row (valid_B), each at its position -> logits [B, V]
    (numpy); the rows' records are appended to `records`."""
    eng = self.engine
    valid = np.asarray(valid_B, bool)
    if valid.shape != (self.max_batch,) or np.shape(tokens_B) != (self.max_batch,):
      raise ValueError(f"a step takes {self.max_batch} tokens and flags, got "
                       f"{np.shape(tokens_B)} and {valid.shape}")
    if np.any(self.pos[valid] >= eng.max_len):
      raise ValueError(f"max_len={eng.max_len} reached")
    pos = np.where(valid, self.pos, 0).astype(np.int32)
    t0 = time.perf_counter()
    carry, self._carry = self._carry, None      # donated: lost if the step fails
    self._carry, logits, packed = decode.step_fn(eng.program)(
        eng.params, eng.sources, carry, np.asarray(tokens_B, np.int32), pos, valid)
    logits, packed = jax.device_get((logits, packed))
    rec = self.record_layout.unpack(packed)
    waits = {}
    if eng.link.emulated:
      low = eng.low_nbytes / eng.store.expert_nbytes()
      waits = eng.charge_link(t0, "a batch step", *link_counts(rec, low))
    self._steps.append((rec, valid, time.perf_counter() - t0, waits))
    self.pos[valid] += 1
    return np.asarray(logits)


def row_records(rec, valid_B, wall_s: float, waits: dict, layout, layers: bool = True
                ) -> list[TokenRecord]:
  """A step's `stats.TokenRecord` per active row, from its numpy `cache.step.Record`
  (per-token fields [L, B K]) -> the row's own counts (`counting.row_counts`: the step's
  admissions and evictions shared by its active rows), the step's time; layers: also
  the row's per-layer decisions.  layout: (MoE layers, an expert's bytes, a
  low-precision copy's)."""
  moe_layers, expert_bytes, low_bytes = layout
  nb = valid_B.shape[0]
  c_BxS = np.sum(step_lib.row_counts(np, rec, valid_B), axis=0, dtype=np.float64)
  out = []
  for b in np.flatnonzero(valid_B):
    r = from_counts(c_BxS[b], expert_bytes, low_bytes)
    if layers:
      part = {f: getattr(rec, f).reshape(getattr(rec, f).shape[:-1] + (nb, -1))[..., b, :]
              for f in _PER_ROW}
      part["fetched"] = np.where(np.isin(part["actions"], (FETCH, FETCH_LOW)), part["ids"], -1)
      r.layers = layer_records(dataclasses.replace(rec, **part), moe_layers)
    r.finish(wall_s, **waits)
    r.rows = int(np.sum(valid_B))
    out.append(r)
  return out


def _row_axis(shape_B, shape_1) -> int:
  """The row axis of a batch's cache leaf: where its shape differs from a sequence's (a
  scanned program's cache is [L, B, ...], an unrolled one's [B, ...]); 0 when B = 1."""
  return next((i for i, (a, b) in enumerate(zip(shape_B, shape_1)) if a != b), 0)


def stack_rows(caches, like):
  """B sequences' caches stacked on a leading axis ([B, ...] leaves of batch-1 caches) as
  one batch cache laid out as `like` (its abstract value)."""
  def one(c, l):
    return jnp.concatenate(list(c), axis=_row_axis(l.shape, c.shape[1:]))
  return jax.tree_util.tree_map(one, caches, like)
