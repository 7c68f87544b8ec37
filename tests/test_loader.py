"""Checkpoint loading: layouts, sharding, mmap, and errors naming file and tensor."""

import json
import os

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.config import ModelConfig
from moejax.io.loader import init_random, load_model, save_hf
from moejax.io.safetensors_io import CheckpointError, SafetensorsFile, save_file

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                  moe_intermediate_size=16, intermediate_size=48,
                  sparse_layers=(True, False), qk_norm="head")


@pytest.fixture(scope="module")
def model():
  return init_random(CFG, seed=3)


def _save(model, d, layout="per_expert"):
  save_hf(CFG, model[0], model[1], str(d), layout=layout)
  return str(d)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("mmap", [False, True])
def test_roundtrip_layouts(model, tmp_path, layout, mmap):
  cfg, params, store = load_model(_save(model, tmp_path, layout), mmap=mmap)
  assert cfg == CFG.validate() or cfg.sparse_layers == CFG.sparse_layers
  assert store.moe_layers == (0,)
  for e in (0, 5):
    chex.assert_trees_all_equal(store.get(0, e), {k: v[e] for k, v in model[1][0].items()})
  np.testing.assert_array_equal(np.asarray(params["layers_1"]["mlp"]["up_proj"]["weight"]),
                                np.asarray(model[0]["layers_1"]["mlp"]["up_proj"]["weight"]))


def test_sharded_index(model, tmp_path):
  d = _save(model, tmp_path / "one")
  f = SafetensorsFile(os.path.join(d, "model.safetensors"))
  names = sorted(f.keys())
  out = tmp_path / "sharded"
  out.mkdir()
  halves = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  wm = {}
  for shard, ns in halves.items():
    save_file({n: np.array(f.get(n)) for n in ns}, str(out / shard))
    wm.update({n: shard for n in ns})
  (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
  (out / "config.json").write_text(open(os.path.join(d, "config.json")).read())
  _, _, store = load_model(str(out))
  np.testing.assert_array_equal(store.get(0, 7)["down"], model[1][0]["down"][7])


def _rewrite(d, fn):
  p = os.path.join(d, "model.safetensors")
  f = SafetensorsFile(p)
  t = {n: np.array(f.get(n)) for n in f.keys()}
  fn(t)
  save_file(t, p)


def test_missing_tensor_is_named(model, tmp_path):
  d = _save(model, tmp_path)
  _rewrite(d, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
  with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight"):
    load_model(d)


def test_wrong_shape_is_named(model, tmp_path):
  d = _save(model, tmp_path)
  _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((3, 3), np.float32)}))
  with pytest.raises(CheckpointError, match=r"q_proj\.weight' has shape \(3, 3\)"):
    load_model(d)


def test_nan_is_named(model, tmp_path):
  d = _save(model, tmp_path)
  def poison(t):
    t["model.layers.0.mlp.experts.2.down_proj.weight"][0, 0] = np.nan
  _rewrite(d, poison)
  with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.weight' contains NaN"):
    load_model(d)


def test_unsupported_dtype_is_named(model, tmp_path):
  d = _save(model, tmp_path)
  _rewrite(d, lambda t: t.update({"model.norm.weight": np.ones((32,), np.int32)}))
  with pytest.raises(CheckpointError, match=r"model\.norm\.weight' has unsupported dtype I32"):
    load_model(d)


def test_truncated_and_missing_files(model, tmp_path):
  d = _save(model, tmp_path)
  p = os.path.join(d, "model.safetensors")
  size = os.path.getsize(p)
  with open(p, "r+b") as f:
    f.truncate(size - 100)
  with pytest.raises(CheckpointError, match="truncated"):
    load_model(d)
  os.remove(p)
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    load_model(d)


def test_bf16_checkpoint_loads(model, tmp_path):
  save_hf(CFG, model[0], model[1], str(tmp_path), dtype=jnp.bfloat16)
  _, params, store = load_model(str(tmp_path), dtype=jnp.bfloat16)
  chex.assert_type([store.get(0, 0)["gate_up"], params["norm"]["weight"]], jnp.bfloat16)


def _rewrite_header(path, fn):
  """Rewrites a safetensors file's JSON header with fn(header) (data unchanged)."""
  import struct
  raw = open(path, "rb").read()
  (n,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8:8 + n])
  fn(header)
  new = json.dumps(header).encode()
  new += b" " * (-len(new) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("field", ["shape", "dtype", "data_offsets"])
def test_header_entry_lacking_a_field_names_file_tensor_and_field(model, tmp_path, field):
  d = _save(model, tmp_path)
  p = os.path.join(d, "model.safetensors")
  _rewrite_header(p, lambda h: h["model.norm.weight"].update(
      {field + "_x": h["model.norm.weight"].pop(field)}))
  with pytest.raises(CheckpointError,
                     match=rf"model\.safetensors: tensor 'model\.norm\.weight'.*'{field}'"):
    load_model(d)


@pytest.mark.parametrize("bad,field", [
    ({"shape": "32"}, "shape"), ({"shape": [-1]}, "shape"), ({"dtype": 7}, "dtype"),
    ({"dtype": "F8_E9"}, "dtype"), ({"data_offsets": [5]}, "data_offsets"),
    ({"data_offsets": [0, 3]}, "data_offsets"), ({"data_offsets": [10 ** 9, 10 ** 9 + 128]}, "truncated"),
])
def test_ill_typed_header_fields_are_named(model, tmp_path, bad, field):
  d = _save(model, tmp_path)
  p = os.path.join(d, "model.safetensors")
  _rewrite_header(p, lambda h: h["model.norm.weight"].update(bad))
  with pytest.raises(CheckpointError, match=rf"tensor 'model\.norm\.weight'.*{field}|"
                                            rf"{field}.*tensor 'model\.norm\.weight'"):
    SafetensorsFile(p)


def test_random_corruptions_always_name_the_file(model, tmp_path):
  # header bytes, header length, truncation, renamed fields, unknown dtypes: every
  # failure is a CheckpointError naming the file, never a bare KeyError / TypeError
  import struct
  d = _save(model, tmp_path / "src")
  src = open(os.path.join(d, "model.safetensors"), "rb").read()
  (n,) = struct.unpack("<Q", src[:8])
  rng = np.random.default_rng(0)
  failures = 0
  for trial in range(60):
    raw = bytearray(src)
    kind = trial % 5
    if kind == 0:                                   # a header byte
      raw[8 + int(rng.integers(0, n))] = int(rng.integers(32, 127))
    elif kind == 1:                                 # the header length
      raw[:8] = struct.pack("<Q", max(0, n + int(rng.integers(-40, 40))))
    elif kind == 2:                                 # truncation
      raw = raw[:int(rng.integers(0, len(raw)))]
    else:
      header = json.loads(raw[8:8 + n])
      name = sorted(k for k in header if k != "__metadata__")[int(rng.integers(0, len(header) - 1))]
      if kind == 3:                                 # a renamed field
        field = ["dtype", "shape", "data_offsets"][int(rng.integers(0, 3))]
        header[name][field.upper()] = header[name].pop(field)
      else:                                         # an unknown dtype
        header[name]["dtype"] = "Q7"
      body = json.dumps(header).encode()
      raw = bytearray(struct.pack("<Q", len(body)) + body + bytes(raw[8 + n:]))
    p = tmp_path / f"c{trial}.safetensors"
    p.write_bytes(bytes(raw))
    try:
      f = SafetensorsFile(str(p))
      for k in f.keys():
        f.get(k)
    except CheckpointError as e:
      assert f"c{trial}.safetensors" in str(e)
      failures += 1
  assert failures >= 30
