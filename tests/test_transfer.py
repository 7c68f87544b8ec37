"""Where the decode program reads the expert store (`placement.program_store`): owned and
shared buffers, memory kinds, the pinned-memory fallback, unreadable stores, errors."""

import dataclasses
import time
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.offload import link as link_lib
from moejax.io import placement
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.io.store import make_store, owned_device_put, shares_buffer
from moejax.io.placement import TransferError, TransferTimeout
from moejax.io.store import ExpertStore
from tests import tiny_models

D, I, E = 32, 16, 8
DEVICE = jax.devices()[0]


def aligned(a, align=64):
  """A copy of `a` in a buffer aligned to `align` bytes: XLA CPU's device_put wraps
  such numpy buffers instead of copying them."""
  raw = np.empty(a.nbytes + align, np.uint8)
  off = -raw.ctypes.data % align
  out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
  out[...] = a
  return out


def make_expert_store(seed=0):
  rng = np.random.default_rng(seed)
  layer = lambda: {"gate_up": aligned(rng.standard_normal((E, 2 * I, D), dtype=np.float32)),
                   "down": aligned(rng.standard_normal((E, D, I), dtype=np.float32))}
  return ExpertStore.from_stacked([None, layer(), layer()])


def assert_same_store(out, store):
  chex.assert_trees_all_equal(out, {l: store.stacked(l) for l in store.moe_layers})


# ---------------------------------------------------------------- owned copies
def test_owned_device_put_never_aliases_numpy_or_memmap(tmp_path):
  sharding = jax.sharding.SingleDeviceSharding(DEVICE)
  x = aligned(np.arange(4096, dtype=np.float32).reshape(64, 64))
  # the hazard on this backend: a plain device_put wraps the numpy buffer
  assert shares_buffer(jax.device_put(x, sharding), x)
  y = owned_device_put(x, sharding)
  assert not shares_buffer(y, x)
  x[0, 0] = -1.0
  assert float(y[0, 0]) == 0.0
  mm = np.memmap(tmp_path / "a.bin", dtype=np.float32, mode="w+", shape=(64, 64))
  mm[:] = 3.0
  z = owned_device_put(mm, sharding)
  assert not shares_buffer(z, mm)
  mm[:] = 4.0
  assert float(z.sum()) == 3.0 * 4096


# ---------------------------------------------------------------- the program store
def test_a_numpy_store_is_handed_over_without_a_copy_on_the_cpu_backend():
  store = make_expert_store()
  out, pinned = placement.program_store(store, DEVICE)
  assert not pinned
  assert_same_store(out, store)
  for l in store.moe_layers:
    for name, arr in store.stacked(l).items():
      assert isinstance(out[l][name], jax.Array)
      assert out[l][name].sharding.memory_kind == "device"
      assert shares_buffer(out[l][name], arr)      # the store's own memory: no second copy


def test_a_pinned_host_store_stays_in_pinned_host_memory():
  store = make_expert_store()
  out, pinned = placement.program_store(make_store(store, "pinned_host"), DEVICE)
  assert pinned
  assert_same_store(out, store)
  assert all(a.sharding.memory_kind == "pinned_host" for layer in out.values()
             for a in layer.values())


def test_sixteen_bit_floats_are_held_as_their_bits():
  store = make_expert_store()
  bf = ExpertStore.from_stacked([None] + [{k: np.asarray(v).astype(jnp.bfloat16)
                                           for k, v in store.stacked(l).items()}
                                          for l in store.moe_layers])
  out, _ = placement.program_store(bf, DEVICE)
  bits = {l: {k: np.asarray(v).view(np.uint16) for k, v in bf.stacked(l).items()}
          for l in bf.moe_layers}
  chex.assert_trees_all_equal(out, bits, strict=True)       # uint16 on the device side too


class _Unreadable:
  """An expert tensor whose bytes cannot be read (a truncated memory-mapped file)."""

  def __array__(self, dtype=None, copy=None):
    raise OSError("truncated file")


def test_an_unreadable_tensor_names_its_layer_and_name():
  store = make_expert_store()
  broken = ExpertStore.from_stacked([None, store.stacked(1), store.stacked(2)])
  broken.layers[2].stacked["gate_up"] = _Unreadable()
  with pytest.raises(TransferError, match=r"'gate_up' of MoE layer 2: OSError: truncated file") \
      as e:
    placement.program_store(broken, DEVICE)
  assert isinstance(e.value.__cause__, OSError)


def _fake_device(platform, kinds):
  return types.SimpleNamespace(
      platform=platform,
      addressable_memories=lambda: [types.SimpleNamespace(kind=k) for k in kinds])


def test_a_device_without_host_memory_is_a_clear_error():
  with pytest.raises(TransferError, match="offers no host memory kind.*memory kinds: device"):
    placement.program_store(make_expert_store(), _fake_device("gpu", ["device"]))


def test_on_an_accelerator_pinning_falls_back_to_unpinned_host_with_one_line(monkeypatch,
                                                                            capsys):
  placed = []

  def put(host, device, kind):
    if kind == "pinned_host":
      raise RuntimeError("cudaHostRegister failed: out of memory\nsecond line")
    placed.append(kind)
    return host
  monkeypatch.setattr(placement, "_put", put)
  store = make_expert_store()
  out, pinned = placement.program_store(store, _fake_device("gpu", ["device", "pinned_host",
                                                                   "unpinned_host"]))
  assert pinned and set(placed) == {"unpinned_host"} and len(placed) == 4
  assert_same_store(out, store)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1
  assert "pinned_host" in err[0] and "unpinned_host" in err[0] and "out of memory" in err[0]
  assert "second line" not in err[0]


def test_when_the_last_memory_kind_fails_it_is_an_error_naming_the_tensor(monkeypatch):
  def put(host, device, kind):
    raise RuntimeError("no memory")
  monkeypatch.setattr(placement, "_put", put)
  with pytest.raises(TransferError, match=r"'gate_up' of MoE layer 1 in unpinned_host memory.*"
                                          r"no memory"):
    placement.program_store(make_expert_store(), _fake_device("gpu", ["unpinned_host"]))


def _tiny_engine_model():
  return tiny_models.tiny_model(np.random.default_rng(0))


def test_a_store_that_cannot_be_pinned_falls_back_with_one_warning_line(monkeypatch, capsys):
  """On the CPU backend a pinned_host store is read from pinned_host memory; when placing
  it there fails, the program reads it from the default memory: one warning line, and the
  engine built on it decodes the logits of a numpy store."""
  cfg, params, store = _tiny_engine_model()
  pinned_store = make_store(store, "pinned_host")
  real_put = placement._put

  def put(host, device, kind):
    if kind == "pinned_host":
      raise RuntimeError("pinning refused")
    return real_put(host, device, kind)
  monkeypatch.setattr(placement, "_put", put)
  out, pinned = placement.program_store(pinned_store, DEVICE)
  assert not pinned
  assert_same_store(out, store)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "warning" in err[0] and "pinning refused" in err[0]

  toks = [3, 17, 5, 60, 22, 9, 4, 8, 15]
  logits = {}
  # a pinned_host store runs the layers unrolled (docs/engine.md): the numpy store's engine
  # is unrolled too, so that the two programs are the same and so are their logits
  for name, st in (("numpy", store), ("fallback", pinned_store)):
    config = dataclasses.replace(EngineConfig.make("quality", cache_fraction=0.25, max_len=16),
                                 layer_scan=False)
    with OffloadEngine(cfg, params, st, config) as eng:
      logits[name] = np.stack([eng.prefill(toks[:4])] + [eng.decode_step(t) for t in toks[4:]])
  err = capsys.readouterr().err.strip().splitlines()
  assert len([line for line in err if "warning" in line]) == 1      # the fallback engine's
  np.testing.assert_array_equal(logits["fallback"], logits["numpy"])


# ---------------------------------------------------------------- errors, waits
def test_error_classes():
  assert issubclass(TransferTimeout, TransferError) and issubclass(TransferError, RuntimeError)


def test_sleep_until_reaches_the_deadline_and_returns_at_once_after_it():
  t0 = time.perf_counter()
  link_lib.sleep_until(t0 + 0.02)
  assert time.perf_counter() >= t0 + 0.02
  t1 = time.perf_counter()
  link_lib.sleep_until(t1 - 1.0)
  assert time.perf_counter() - t1 < 1e-3
