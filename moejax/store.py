"""ExpertStore: the routed experts of every MoE layer, on the host, by (layer, expert).

Each MoE layer holds a dict of arrays with a leading expert axis in moejax's
canonical layout ``{"gate_up": [E, 2I, D], "down": [E, D, I]}``.  The arrays are
numpy arrays in RAM, or read-only memmaps of the checkpoint (``mmap=True``,
disk tier) when the checkpoint stores the fused layout; per-expert checkpoints
are kept as per-expert views and concatenated on access.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class LayerExperts:
  """Either stacked arrays {name: [E, ...]} or a per-expert getter."""
  num_experts: int
  stacked: dict[str, np.ndarray] | None = None
  getter: Callable[[int], dict[str, np.ndarray]] | None = None

  def expert(self, e: int) -> dict[str, np.ndarray]:
    if not 0 <= e < self.num_experts:
      raise IndexError(f"expert {e} out of range [0, {self.num_experts})")
    if self.stacked is not None:
      return {k: v[e] for k, v in self.stacked.items()}
    return self.getter(e)

  def stack(self) -> dict[str, np.ndarray]:
    if self.stacked is not None:
      return self.stacked
    per = [self.getter(e) for e in range(self.num_experts)]
    return {k: np.stack([p[k] for p in per]) for k in per[0]}


class ExpertStore:
  """Host-side routed experts, addressable by (layer, expert)."""

  def __init__(self, layers: dict[int, LayerExperts], num_layers: int, backend: str = "numpy"):
    self.layers = layers
    self.num_layers = num_layers
    self.backend = backend  # "numpy" | "mmap" | "pinned_host" (moejax.offload.host_store)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(sorted(self.layers))

  def get(self, layer: int, expert: int) -> dict[str, np.ndarray]:
    if layer not in self.layers:
      raise KeyError(f"layer {layer} has no routed experts")
    return self.layers[layer].expert(expert)

  def stacked(self, layer: int) -> dict[str, np.ndarray]:
    return self.layers[layer].stack()

  def expert_nbytes(self, layer: int | None = None) -> int:
    layer = self.moe_layers[0] if layer is None else layer
    return sum(int(v.nbytes) for v in self.get(layer, 0).values())

  def to_device(self, dtype=None) -> list:
    """All experts resident: per layer a dict of device arrays (None for dense layers).

    Arrays are copied (``jnp.array``), never aliased to the host buffers.
    """
    out = []
    for i in range(self.num_layers):
      if i not in self.layers:
        out.append(None)
        continue
      st = self.stacked(i)
      # `dtype` casts floating tensors only: MXFP4 blocks/scales (uint8) keep their bytes.
      out.append({k: jnp.array(np.asarray(v), dtype=(dtype if dtype and _is_float(v.dtype)
                                                     else _jnp_dtype(v.dtype)))
                  for k, v in st.items()})
    return out

  @classmethod
  def from_stacked(cls, per_layer: list, num_layers: int | None = None) -> "ExpertStore":
    """Build from a list over layers of {name: [E, ...]} (None for dense layers)."""
    layers = {}
    for i, st in enumerate(per_layer):
      if st is None:
        continue
      st = {k: np.asarray(v) for k, v in st.items()}
      layers[i] = LayerExperts(num_experts=next(iter(st.values())).shape[0], stacked=st)
    return cls(layers, num_layers if num_layers is not None else len(per_layer))


def _jnp_dtype(dt):
  return jnp.dtype(dt)


def _is_float(dt) -> bool:
  return jnp.issubdtype(jnp.dtype(dt), jnp.floating)
