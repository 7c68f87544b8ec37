"""The background-admission queue: which admissions wait for their insert, per layer.

An admission requested at token t for MoE layer l logically takes effect before
layer l's decision at token t+1.  The engine may insert it earlier, while a
synchronous fetch of another layer crosses the link, once it has arrived: no
use of layer l's state comes in between, so the insert and its results are the
same.  Its statistics are *carried* to the token and layer where it logically
takes effect, so records do not depend on thread timing.

`Admissions` is an immutable value; every function takes one and returns the
next (state in, state out).  Tickets are `transfer.Ticket`s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from moejax.offload.tickets import BACKGROUND


@dataclasses.dataclass(frozen=True)
class Carried:
  """An insert made ahead of its logical token: its experts and evicted-id arrays."""
  admitted: tuple[int, ...] = ()
  evicted: tuple[Any, ...] = ()      # device arrays of evicted ids (-1: none)


@dataclasses.dataclass(frozen=True)
class Admissions:
  pending: Mapping[int, tuple] = dataclasses.field(default_factory=dict)   # layer -> tickets
  carried: Mapping[int, Carried] = dataclasses.field(default_factory=dict)


def init(layers) -> Admissions:
  return Admissions({l: () for l in layers}, {l: Carried() for l in layers})


def request(adm: Admissions, layer: int, tickets) -> Admissions:
  """Adds the layer's new background tickets (in request order)."""
  return dataclasses.replace(adm, pending={**adm.pending,
                                           layer: adm.pending[layer] + tuple(tickets)})


def arrived(adm: Admissions, layer: int) -> bool:
  """True when the layer has pending admissions and every one is done."""
  pend = adm.pending[layer]
  return bool(pend) and all(t.done() for t in pend)


def take(adm: Admissions, layer: int) -> tuple[Admissions, list]:
  """Removes the layer's pending tickets; returns those still to insert (a ticket a
  synchronous fetch took over, upgraded to "sync", was inserted by that fetch)."""
  if not adm.pending[layer]:
    return adm, []
  ready = [t for t in adm.pending[layer] if t.priority == BACKGROUND]
  return dataclasses.replace(adm, pending={**adm.pending, layer: ()}), ready


def carry(adm: Admissions, layer: int, admitted, evicted) -> Admissions:
  """Records an insert made ahead of its logical token (see the module docstring)."""
  c = adm.carried[layer]
  c = Carried(c.admitted + tuple(int(e) for e in admitted), c.evicted + tuple(evicted))
  return dataclasses.replace(adm, carried={**adm.carried, layer: c})


def collect(adm: Admissions, layer: int) -> tuple[Admissions, Carried]:
  """The layer's carried inserts, now attributed to the current token."""
  c = adm.carried[layer]
  if not c.admitted and not c.evicted:
    return adm, c
  return dataclasses.replace(adm, carried={**adm.carried, layer: Carried()}), c


def all_tickets(adm: Admissions) -> list:
  return [t for pend in adm.pending.values() for t in pend]
