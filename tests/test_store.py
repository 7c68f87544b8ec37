"""ExpertStore back-ends (numpy, mmap, pinned_host) hold identical experts."""

import os
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.config import ModelConfig
from moejax.io import repack
from moejax.io.loader import init_random, load_model, save_hf
from moejax.io import placement
from moejax.offload.engine import EngineConfig, OffloadEngine
from moejax.io.store import (BACKENDS, LayerExperts, StoreBackendError, layer_stacked, make_store,
                             shares_buffer)
from moejax.io.safetensors_io import SafetensorsFile
from moejax.io.store import ExpertStore

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
      assert set(b) == {"gate_up", "down"}
      chex.assert_trees_all_equal(a, b, strict=True)      # keys, shapes, dtypes and values


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
  # repacked once into a stacked f32 file in the cache folder, mapped, not read into RAM
  for i in mm.moe_layers:
    for v in mm.stacked(i).values():
      assert isinstance(v, np.memmap) and v.dtype == np.float32 and repack.aligned(v)
      assert os.path.realpath(v.filename).startswith(os.path.realpath(repack.cache_root()))
  assert_same_experts(mm, ram)
  _, _, again = load_model(dirs["fused_bf16"], mmap=True)     # the same file, reused
  assert again.stacked(2)["gate_up"].filename == mm.stacked(2)["gate_up"].filename


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
    # one tensor per kind over the MoE layers, each layer a view of it (`layer_stacked`)
    j = st.moe_layers.index(1)
    np.testing.assert_array_equal(f.get("experts.gate_up")[j, 2], exps[1]["gate_up"][2])
    whole = layer_stacked(st)
    assert whole is not None and whole["gate_up"].shape[0] == len(st.moe_layers)
    np.testing.assert_array_equal(whole["down"][j], exps[1]["down"])
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


def test_every_backend_gives_the_program_identical_experts_and_the_same_decoding(model):
  """The decode program's view of the store (`placement.program_store`) holds the same
  experts from every back-end (also a per-expert checkpoint memory-mapped), and engines
  over them decode identical logits and records."""
  exps, dirs = model
  cfg, params, ref = load_model(dirs["per_expert"])
  _, _, per_expert_mm = load_model(dirs["per_expert"], mmap=True)
  stores = {b: make_store(ref, b) for b in BACKENDS}
  stores["mmap(per_expert checkpoint)"] = per_expert_mm
  toks = [3, 17, 5, 60, 22, 9, 4, 8, 15, 16]
  runs = {}
  for name, st in stores.items():
    out, pinned = placement.program_store(st, jax.devices()[0])
    assert pinned == (name == "pinned_host"), name
    chex.assert_trees_all_equal({i: out[i] for i in (1, 2)}, {i: exps[i] for i in (1, 2)})
    with OffloadEngine(cfg, params, st, EngineConfig.make("quality", cache_fraction=0.25, max_len=16)) as eng:
      logits = [eng.prefill(toks[:4])] + [eng.decode_step(t) for t in toks[4:]]
      runs[name] = (np.stack(logits), [r.layers for r in eng.records])
  for name, (logits, layers) in runs.items():
    np.testing.assert_array_equal(logits, runs["numpy"][0], err_msg=name)
    assert layers == runs["numpy"][1], name


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


def test_layer_stacked_is_one_view_per_kind_over_the_moe_layers(model):
  exps, dirs = model
  ref = ExpertStore.from_stacked(exps)
  whole = layer_stacked(ref)                   # from_stacked copied into [L, E, ...] once
  assert set(whole) == {"gate_up", "down"} and whole["gate_up"].shape[:2] == (2, CFG.num_experts)
  assert np.shares_memory(whole["gate_up"], ref.stacked(2)["gate_up"])
  np.testing.assert_array_equal(whole["gate_up"][1], exps[2]["gate_up"])
  for kw in ({}, {"mmap": True}):              # read into RAM; repacked into one file
    st = load_model(dirs["per_expert"], **kw)[2]
    w = layer_stacked(st)
    assert w is not None, kw
    np.testing.assert_array_equal(np.asarray(w["down"][0]), exps[1]["down"])
  # layers allocated apart (or a getter per expert) are not one array: None
  apart = ExpertStore({l: LayerExperts(CFG.num_experts, stacked={k: np.array(v) for k, v in
                                                                 exps[l].items()})
                       for l in (1, 2)}, CFG.num_layers)
  assert layer_stacked(apart) is None
