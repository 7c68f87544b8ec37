"""Control miss rules for the emulator's experiments (not policies).

A control chooses which misses are waited for; everything else (substitutes,
admission, eviction) is `policy.decide` with the `substitute_all` rule seeing the
waited-for misses as resident, so substitutes follow the spec exactly.  Used by
the quality study to substitute a chosen share of calls without the threshold
rule's protection of heavy experts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.model import routing
from moejax.model.config import ModelConfig
from moejax.cache import policy as policy_lib
from moejax.cache.policy import FETCH, Decision, DecideParams
from moejax.cache.resident import ResidentState


class ControlError(ValueError):
  """A bad control specification; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Control:
  """An emulator-only *control* miss rule (for experiments, not a policy preset).

  Which misses are waited for is chosen here; everything else (substitutes,
  admission, eviction) is `policy.decide` with the `substitute_all` rule seeing
  the waited-for misses as resident, so substitutes follow the spec exactly.

    random:  each miss is substituted with probability `prob` (the first
             choice too, unless protect_first), independently per call.
    band:    misses whose share g / sum(g) is in [lo, hi) are substituted with
             probability `prob`, the first choice never (unless protect_first
             is False); all other misses are waited for.
  """
  kind: str = "random"
  prob: float = 1.0
  lo: float = 0.0
  hi: float = 1.0
  protect_first: bool = False
  seed: int = 0

  def __post_init__(self):
    if self.kind not in ("random", "band"):
      raise ControlError(f"control kind must be 'random' or 'band', got {self.kind!r}")
    if not 0.0 <= self.prob <= 1.0:
      raise ControlError(f"control prob must be in [0, 1], got {self.prob}")


def decide(c: Control, logits_1xE, state: ResidentState, decision: DecideParams,
           cfg: ModelConfig, key) -> Decision:
  """`policy.decide` (substitute_all) with the control's waited-for misses seen as
  resident; those misses are then FETCH."""
  routed = routing.route(cfg, logits_1xE)
  ids, gates = routed.ids, routed.gates
  share = gates / jnp.sum(gates, axis=-1, keepdims=True)     # as decide's share
  miss = state.expert_slot[ids] < 0
  first = jnp.arange(ids.shape[-1])[None, :] == 0
  coin = jax.random.uniform(key, ids.shape) < c.prob
  if c.kind == "random":
    sub = miss & coin
  else:
    sub = miss & coin & (share >= c.lo) & (share < c.hi)
  if c.protect_first:
    sub = sub & ~first
  wait = miss & ~sub
  fake_slot = state.expert_slot.at[jnp.where(wait, ids, cfg.num_experts)].set(0, mode="drop")
  dec = policy_lib.decide(logits_1xE, dataclasses.replace(state, expert_slot=fake_slot),
                          dataclasses.replace(decision, miss="substitute_all"), cfg)
  return dataclasses.replace(dec, action=jnp.where(wait, FETCH, dec.action).astype(jnp.int32))
