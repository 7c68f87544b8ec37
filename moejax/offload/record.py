"""A decode step's record at the program boundary: the `cache.step.Record` [L, ...] packed
into one f32 array (`pack`), and read back on the host by its `RecordLayout` (made by
`decode.record_layout` when a program is built)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cache import step as step_lib


def pack(rec):
  """A step's `Record` [L, ...] as ONE f32 array [L, width] at the program boundary: a
  CPU step pays a fixed cost per output buffer (14 fields: the demo's all-resident engine
  ran at 0.66x the speed of one packed output).  The fields follow the Record's own
  order, and `RecordLayout.unpack` takes their widths from its abstract value, so no field
  order or offset is written down twice.  Ids, slots and counts are small integers: exact
  in f32."""
  leaves = jax.tree_util.tree_leaves(rec)
  return jnp.concatenate([x.astype(jnp.float32) for x in leaves], axis=-1)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
  """What a program's packed step record ([..., L, width], `pack`) was packed from: the
  abstract `cache.step.Record` [L, ...] (`record_layout`), known when the program is
  built, before any step has run."""
  like: step_lib.Record

  @property
  def width(self) -> int:
    return sum(x.shape[-1] for x in jax.tree_util.tree_leaves(self.like))

  @property
  def packed_like(self) -> jax.ShapeDtypeStruct:
    """The abstract packed record [L, width]."""
    return jax.eval_shape(pack, self.like)

  def unpack(self, packed) -> step_lib.Record:
    """`pack`'s inverse on the host: the numpy `Record` (its own arrays, no view keeping
    a device buffer alive) from `packed` [..., L, width]."""
    if np.shape(packed)[-1] != self.width:
      raise ValueError(f"a packed record of width {np.shape(packed)[-1]}, where this "
                       f"program's Record packs to {self.width}: it was made by another program")
    leaves, treedef = jax.tree_util.tree_flatten(self.like)
    out, at = [], 0
    for x in leaves:
      n = x.shape[-1]
      out.append(np.array(packed[..., at:at + n], dtype=x.dtype))
      at += n
    return jax.tree_util.tree_unflatten(treedef, out)
