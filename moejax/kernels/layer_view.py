"""One layer of a stacked [L, ...] array inside a scan over layers, read in place.

Under a `lax.scan` (a while loop) over layers, XLA CPU copies a layer sliced out of a
stacked operand into a buffer of its own before each custom call that reads it: a chain
of `cpu_matmul.linear` calls over stacked [L, 4096, 2048] bf16 weights went from 72 to
151 ms (docs/engine.md, "The layers as one scan").  So while the scan's body is traced
(inside `tracing()`), `at(stack, i)` is stack[i] and is remembered as layer i of
`stack`: a kernel wrapper handed that slice asks `common` and calls its `_at` variant on
the whole stack and i (`cpu_matmul.linears`, `apply_experts`, `cpu_attention`,
`cpu_host`), which reads the layer where it lies; the slice, unused, is dropped by XLA.
Where no kernel reads it (another platform, MOEJAX_CPU_KERNEL=0, an XLA op) the slice is
what it always was: a dynamic index.

A carried stack (the KV cache, the slot buffers) is updated at (i, ...) in place in the
loop's carry: `update` writes into the stack and returns the view of the new one, which
`stack_at` hands back to the scan.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import cpu_rows

_local = threading.local()     # per tracing thread: views {id(slice): _Entry}


class View(NamedTuple):
  """What a slice made by `at` is: layer i of `stack`."""
  stack: Any
  i: Any


class Common(NamedTuple):
  """Slices that are all layer i of their stacks (`common`)."""
  stacks: list
  i: Any


class _Entry(NamedTuple):
  slice: Any      # the slice itself (its id may be reused once it is gone)
  view: View


def _views() -> dict:
  if not hasattr(_local, "views"):
    _local.views, _local.depth = {}, 0
  return _local.views


@contextlib.contextmanager
def tracing():
  """Views made inside (on this thread) are remembered (a scan body's trace); forgotten
  on leaving the outermost."""
  _views()
  _local.depth += 1
  try:
    yield
  finally:
    _local.depth -= 1
    if _local.depth == 0:
      _local.views.clear()


def at(stack, i):
  """stack[i] (i a traced int32 scalar), remembered as layer i of `stack` inside
  `tracing()`."""
  x = jax.lax.dynamic_index_in_dim(stack, i, keepdims=False)
  _views()
  if _local.depth:
    _local.views[id(x)] = _Entry(x, View(stack, i))
  return x


def of(x) -> View | None:
  """The `View` (stack, i) when x is `at(stack, i)`, else None."""
  e = _views().get(id(x))
  return e.view if e is not None and e.slice is x else None


def common(xs) -> Common | None:
  """`Common` ([stack of each x], i) when every x is a view of the same layer i, else
  None."""
  vs = [of(x) for x in xs]
  if not vs or any(v is None for v in vs) or any(v.i is not vs[0].i for v in vs):
    return None
  return Common([v.stack for v in vs], vs[0].i)


def stack_at(x, i):
  """The stack x is layer i of (after `update`s), else None."""
  v = of(x)
  return v.stack if v is not None and v.i is i else None


def update(x, new, idx):
  """`lax.dynamic_update_slice(x, new, idx)`, the one row writer of the caches and slot
  buffers; x a view: its stack updated at (i, *idx) (in place in a loop's carry), and the
  view of the new stack returned.  16-bit floats (new may come as their uint16 bits) are
  written in place by `cpu_rows.write_rows` on the CPU, elsewhere as uint16 bits (XLA's
  CPU backend runs a bf16 update in f32, converting the whole array to f32 and back)."""
  v = of(x)
  base, off = (x, ()) if v is None else (v.stack, (v.i,))
  bits = base.dtype.itemsize == 2 and jnp.issubdtype(base.dtype, jnp.floating)
  u16 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) if bits else a
  if not (bits and new.dtype == jnp.uint16):   # rows of a 16-bit float array may come as bits
    new = u16(new.astype(base.dtype))
  new = new.reshape((1,) * len(off) + new.shape)
  start = off + tuple(idx)

  def xla(b, n):
    out = jax.lax.dynamic_update_slice(u16(b), u16(n), start)
    return jax.lax.bitcast_convert_type(out, base.dtype) if bits else out
  if bits:   # on the CPU written in place by a kernel: XLA fused the update of the uint16
    # view with the bitcasts into a loop over the whole stack (a KV cache at every step)
    k = base.ndim      # the indexed dims: up to the last that is not a whole one at 0
    while k > 1 and new.shape[k - 1] == base.shape[k - 1] and _zero(start[k - 1]):
      k -= 1
    out = cpu_rows.write_rows(base, jax.lax.bitcast_convert_type(new, base.dtype), start[:k],
                              xla)
  else:
    out = xla(base, new)
  return out if v is None else at(out, v.i)


def copy_row(dst, at_row, src, row):
  """`update(dst, rows(src, row, 1), (at_row, 0, ...))`: src's row `row` written at row
  `at_row` of dst, either a view of a stack (layer i, as `rows` and `update` read them);
  on the CPU one copy from src's buffer into dst's, in place (`cpu_rows.copy_rows`), where
  XLA would slice the row out into a buffer of its own and then copy it again."""
  vd, vs = of(dst), of(src)
  dbase, doff = (dst, ()) if vd is None else (vd.stack, (vd.i,))
  sbase, soff = (src, ()) if vs is None else (vs.stack, (vs.i,))
  d_at, s_at = doff + (at_row,), soff + (row,)

  def xla(d, s):   # elsewhere (and when the kernel does not apply): slice, then update
    block = jax.lax.dynamic_slice(s, s_at + (0,) * (s.ndim - len(s_at)),
                                  (1,) * len(s_at) + s.shape[len(s_at):])
    block = block.reshape((1,) * len(d_at) + d.shape[len(d_at):])
    return update(d, block, d_at + (0,) * (d.ndim - len(d_at)))
  out = cpu_rows.copy_rows(dbase, d_at, sbase, s_at, xla)
  return out if vd is None else at(out, vd.i)


def will_need(srcs, rows_J, n):
  """n, once the OS has been asked to read rows rows_J[:n] of each src (a view: of its
  stack at layer i) into the page cache (`cpu_rows.will_need`): a loop of `copy_row`s
  bounded by the result reads a memory-mapped store's blocks together, not one by one."""
  for src in srcs:
    v = of(src)
    base, at = (src, rows_J[:, None]) if v is None else (
        v.stack, jnp.stack([jnp.broadcast_to(v.i, rows_J.shape), rows_J], axis=1))
    n = cpu_rows.will_need(base, at.astype(jnp.int32), n)
  return n


def _zero(i) -> bool:
  return isinstance(i, (int, np.integer)) and int(i) == 0


def rows(x, start, size: int):
  """x[start:start + size] along its first axis; x a view: sliced from its stack at
  (i, start), never the whole layer."""
  v = of(x)
  if v is None:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)
  zero = (0,) * (v.stack.ndim - 2)
  return jax.lax.dynamic_slice(v.stack, (v.i, start) + zero,
                               (1, size) + v.stack.shape[2:])[0]
