"""ExpertStore back-ends (numpy, mmap, pinned_host) hold identical experts."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.loader import init_random, load_model, save_hf
from moejax.offload.host_store import BACKENDS, StoreBackendError, make_store
from moejax.offload.link import NATIVE
from moejax.offload.copies import shares_buffer
from moejax.offload.transfer import Prefetcher
from moejax.safetensors_io import SafetensorsFile
from moejax.store import ExpertStore

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                  moe_intermediate_size=16, intermediate_size=64,
                  sparse_layers=(False, True, True), qk_norm="head").validate()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  params, exps = init_random(CFG, seed=3)
  dirs = {}
  for layout in ("per_expert", "fused"):
    dirs[layout] = str(tmp_path_factory.mktemp(layout))
    save_hf(CFG, params, exps, dirs[layout], layout=layout)
  dirs["fused_bf16"] = str(tmp_path_factory.mktemp("fused_bf16"))
  save_hf(CFG, params, exps, dirs["fused_bf16"], layout="fused", dtype=jnp.bfloat16)
  return exps, dirs


def assert_same_experts(store, ref):
  assert store.moe_layers == ref.moe_layers == (1, 2)
  for i in ref.moe_layers:
    for e in range(CFG.num_experts):
      a, b = store.get(i, e), ref.get(i, e)
      assert set(a) == set(b) == {"gate_up", "down"}
      for k in b:
        assert np.asarray(a[k]).dtype == np.asarray(b[k]).dtype
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=f"{i},{e},{k}")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_mmap_loader_gives_the_ram_experts_for_both_layouts(model, layout):
  exps, dirs = model
  _, _, ram = load_model(dirs[layout])
  _, _, mm = load_model(dirs[layout], mmap=True)
  assert (ram.backend, mm.backend) == ("numpy", "mmap")
  assert_same_experts(mm, ExpertStore.from_stacked(exps))
  assert_same_experts(mm, ram)
  # the down projection comes straight from the file mapping in both layouts
  assert isinstance(mm.get(1, 5)["down"], np.memmap)


def test_mmap_checkpoint_in_another_dtype_stays_on_disk(model):
  _, dirs = model
  _, _, ram = load_model(dirs["fused_bf16"])  # bf16 file read as f32 into RAM
  _, _, mm = load_model(dirs["fused_bf16"], mmap=True)
  assert all(mm.layers[i].stacked is None for i in mm.moe_layers)  # converted per expert
  assert mm.get(2, 4)["gate_up"].dtype == np.float32
  assert_same_experts(mm, ram)


@pytest.mark.parametrize("backend", BACKENDS)
def test_make_store_backends_hold_identical_experts(model, backend, tmp_path):
  exps, _ = model
  ref = ExpertStore.from_stacked(exps)
  kw = {"path": str(tmp_path)} if backend == "mmap" else {}
  st = make_store(ref, backend, **kw)
  assert st.backend == backend
  assert_same_experts(st, ref)
  x = st.get(1, 2)["gate_up"]
  if backend == "pinned_host":
    assert isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host"
    assert not shares_buffer(x, ref.get(1, 2)["gate_up"])
  elif backend == "mmap":
    assert isinstance(x, np.memmap)
    f = SafetensorsFile(os.path.join(str(tmp_path), "experts.safetensors"))
    np.testing.assert_array_equal(f.get("layers.1.gate_up")[2], exps[1]["gate_up"][2])
  else:
    assert st is ref  # already numpy
  # stacked / to_device views agree too
  np.testing.assert_array_equal(np.asarray(st.to_device()[2]["down"]), exps[2]["down"])
  assert st.expert_nbytes() == ref.expert_nbytes()


def test_conversions_chain_without_changing_an_expert(model):
  exps, _ = model
  ref = ExpertStore.from_stacked(exps)
  mm = make_store(ref, "mmap")  # spilled to a temporary folder
  pinned = make_store(mm, "pinned_host")
  back = make_store(pinned, "numpy")
  assert back.backend == "numpy" and not isinstance(back.get(1, 0)["down"], np.memmap)
  assert_same_experts(back, ref)
  assert make_store(pinned, "pinned_host") is pinned


def test_prefetcher_transfers_identical_arrays_from_every_backend(model, tmp_path):
  exps, dirs = model
  ref = ExpertStore.from_stacked(exps)
  _, _, per_expert_mm = load_model(dirs["per_expert"], mmap=True)
  stores = {b: make_store(ref, b) for b in BACKENDS}
  stores["mmap(per_expert checkpoint)"] = per_expert_mm
  keys = [(1, 0), (1, 7), (2, 3)]
  for name, st in stores.items():
    with Prefetcher(st, NATIVE) as pf:
      got = {k: pf.request(*k).wait(5.0) for k in keys}
      assert pf.stats()["bytes"] == len(keys) * ref.expert_nbytes(), name
    for (i, e), arrays in got.items():
      for k, v in arrays.items():
        assert v.sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(v), exps[i][k][e], err_msg=f"{name} {i},{e}")


def test_unknown_backend_names_the_flag_and_the_choices(model):
  exps, _ = model
  with pytest.raises(StoreBackendError, match=r"--store='gpu'.*numpy, mmap, pinned_host") as e:
    make_store(ExpertStore.from_stacked(exps), "gpu")
  assert isinstance(e.value, ValueError)


def test_pinned_host_unavailable_is_a_clear_error(model):
  exps, _ = model
  no_pinned = types.SimpleNamespace(
      addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
  with pytest.raises(StoreBackendError, match="'pinned_host' is unavailable.*offers memory "
                                              "kinds device"):
    make_store(ExpertStore.from_stacked(exps), "pinned_host", device=no_pinned)
