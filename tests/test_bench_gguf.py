"""The benchmarks' GGUF models (issue 61) without llama.cpp: the wide_q* names and where
their files go (benchmarks.models.wide_gguf), llama_cpp.quantize's refusals, bench_scale's
--weights limit rule, and bench_offload on a GGUF file (tests/test_gguf.py's writer)."""

import json
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import pytest
from absl.testing import flagsaver

from benchmarks import llama_cpp, memcg, models as bench_models, scale as bench_scale, scale_disk
from tests.test_bench_scale import run_main


def test_names_split_into_kind_dtype_and_format():
  for name, fmt in (("wide_q8_0", "q8_0"), ("wide_q4_0", "q4_0"), ("wide_q4_k_m", "q4_k_m"),
                    ("wide_bf16", "bf16"), ("demo_f32", "f32")):
    assert name in bench_models.NAMES and bench_models.weights_of(name) == fmt
    kind, dtype = bench_models.split_name(name)
    assert kind == name.split("_")[0]
    assert dtype == (jnp.float32 if fmt == "f32" else jnp.bfloat16)  # blocks compute in bf16
  with pytest.raises(ValueError, match="unknown model 'wide_q5_0'"):
    bench_models.split_name("wide_q5_0")
  # llama-quantize --pure for the formats whose every linear is in that format
  assert bench_models.GGUF_FORMATS == {"q8_0": True, "q4_0": True, "q4_k_m": False}


def _no_llama_cpp(monkeypatch):
  def refuse(*a, **kw):
    raise AssertionError("llama.cpp was asked for")
  for fn in ("build", "convert", "quantize", "build_quantize"):
    monkeypatch.setattr(llama_cpp, fn, refuse)


def _wide_folder(root, layers=4):
  d = bench_models.wide_dir(layers, str(root))
  os.makedirs(d)
  with open(os.path.join(d, "tokenizer.json"), "w") as f:
    f.write('{"tok": 1}')
  return d


def test_an_existing_gguf_is_used_as_it_is_with_its_tokenizer_beside_it(tmp_path, monkeypatch):
  _no_llama_cpp(monkeypatch)
  _wide_folder(tmp_path / "models")
  g = bench_models.wide_gguf_path(4, "q4_0", str(tmp_path / "models"), gguf_dir=str(tmp_path))
  assert g == str(tmp_path / "wide_bf16_4L_routed-q4_0" / "wide_bf16_4L_routed-q4_0.gguf")
  assert bench_models.wide_gguf_path(4, "bf16", str(tmp_path / "models"),
                                     gguf_dir=str(tmp_path)).endswith(
                                         f"{os.sep}wide_bf16_4L_routed-bf16.gguf")
  os.makedirs(os.path.dirname(g))
  open(g, "wb").close()
  assert bench_models.wide_gguf(4, "q4_0", str(tmp_path / "models"),
                                gguf_dir=str(tmp_path)) == g
  with open(os.path.join(os.path.dirname(g), "tokenizer.json")) as f:
    assert f.read() == '{"tok": 1}'       # the loader reads the tokenizer beside the file
  with pytest.raises(ValueError, match="format 'q5_k'"):
    bench_models.wide_gguf_path(4, "q5_k")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k_m"])
def test_a_missing_gguf_is_quantized_from_the_bf16_one(tmp_path, monkeypatch, fmt):
  _no_llama_cpp(monkeypatch)
  root = tmp_path / "models"
  _wide_folder(root)
  src = bench_models.wide_gguf_path(4, "bf16", str(root), gguf_dir=str(tmp_path))
  open(src, "wb").close()          # the bf16 GGUF exists: no conversion, no model written
  calls = []

  def quantize(cache, s, qtype, out, pure):
    calls.append((s, qtype, pure))
    open(out, "wb").close()
    return out
  monkeypatch.setattr(llama_cpp, "quantize", quantize)
  g = bench_models.wide_gguf(4, fmt, str(root), gguf_dir=str(tmp_path))
  assert os.path.exists(g) and calls == [(src, fmt, fmt == "q4_0")]
  assert os.path.exists(os.path.join(os.path.dirname(g), "tokenizer.json"))


def test_quantize_refuses_a_short_disk_before_building(tmp_path, monkeypatch):
  quantize = llama_cpp.quantize
  _no_llama_cpp(monkeypatch)
  src = tmp_path / "m-bf16.gguf"
  src.write_bytes(b"\0" * 1000)
  monkeypatch.setattr(llama_cpp.shutil, "disk_usage",
                      lambda p: types.SimpleNamespace(free=10**9))
  with pytest.raises(OSError, match="needs 1.1 GB free .* has 1.0 GB"):
    quantize("cache", str(src), "q4_0", str(tmp_path / "q" / "m-q4_0.gguf"), pure=True)
  with pytest.raises(ValueError, match="type 'q5_0'"):
    quantize("cache", str(src), "q5_0", str(tmp_path / "q" / "m-q5_0.gguf"), pure=True)
  done = tmp_path / "done.gguf"
  done.write_bytes(b"x")               # an existing output is returned as it is
  assert quantize("cache", str(src), "q4_0", str(done), pure=True) == str(done)
  # the bound: the bits of the widest type each format writes, over bf16's 16
  assert llama_cpp.quantize_bytes(str(src), "q4_0") == 1000 * 4.5 // 16 + (64 << 20)


def test_bench_scale_limit_is_the_bf16_runs_share_of_the_model():
  b16, q4 = bench_models.wide_bytes(24), bench_models.wide_bytes(24, "q4_0")
  assert abs(b16 / 30e9 - 1) < 0.01 and 8.3e9 < q4 < 8.6e9           # the sizes
  assert bench_scale.default_limit_gb(24, "bf16") == 12.0
  lim = bench_scale.default_limit_gb(24, "q4_0")
  assert lim == pytest.approx(12.0 * q4 / b16) and 3.3 < lim < 3.45     # "about 3.4 GB"
  assert bench_scale.default_limit_gb(24, "q8_0") == pytest.approx(
      12.0 * bench_models.wide_bytes(24, "q8_0") / b16)


def test_bench_scale_q4_0_plans_the_blocks_and_names_a_fraction_that_fits(tmp_path, monkeypatch,
                                                                          capsys):
  monkeypatch.setattr(memcg, "available", lambda: None)
  with flagsaver.flagsaver():
    bench_scale.FLAGS(["bench_scale", "--weights=q4_0"])
    plan, needs = bench_scale.plan_needs(24)
    bench_scale.FLAGS(["bench_scale", "--weights=bf16"])
    plan16, _ = bench_scale.plan_needs(24)
  assert plan["expert_bytes"] == 3 * 768 * 2048 // 32 * 18          # Q4_0: 18 bytes / 32
  assert plan["anon_bytes"] < 0.4 * plan16["anon_bytes"]
  # at 25% moejax's plan + 1 GB exceeds the default 3.38 GB: the refusal names a fraction
  assert needs > bench_scale.default_limit_gb(24, "q4_0") * 1e9
  assert run_main(tmp_path, "--layers=24", "--weights=q4_0") == 2
  line = capsys.readouterr().err.strip().splitlines()[0]
  assert "--memory_limit_gb=3.37868 is below" in line and "--cache_fraction=" in line
  fits = float(line.rsplit("--cache_fraction=", 1)[1].split()[0])
  assert 0.125 <= fits < 0.25
  # at that fraction the limit holds; the disk check then counts the q4_0 GGUF to make
  monkeypatch.setattr(scale_disk.shutil, "disk_usage",
                      lambda p: types.SimpleNamespace(free=10**9))
  assert run_main(tmp_path, "--layers=24", "--weights=q4_0", f"--cache_fraction={fits}") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "q4_0 GGUF 85" in err[0] and "it has 1000000000" in err[0]
  assert not [p for p in tmp_path.iterdir() if p.name != "out.json"]


def test_gguf_paths_of_bench_scale(tmp_path):
  with flagsaver.flagsaver():
    bench_scale.FLAGS(["bench_scale", "--weights=q4_0", "--layout=fused",
                       f"--model_root={tmp_path}", f"--gguf_dir={tmp_path / 'g'}"])
    d, g = bench_scale.paths(24)
  assert d == str(tmp_path / "wide_bf16_24L_routed_fused")
  assert g == str(tmp_path / "g" / "wide_bf16_24L_routed_fused-q4_0"
                  / "wide_bf16_24L_routed_fused-q4_0.gguf")
  assert bench_scale.tokenizer(g) == os.path.join(os.path.dirname(g), "tokenizer.json")
  assert bench_scale.tokenizer(d) == os.path.join(d, "tokenizer.json")
  assert bench_scale.gguf_nbytes(d) is None


def test_bench_offload_runs_a_gguf_file_and_plans_its_blocks(tmp_path):
  pytest.importorskip("gguf", reason="gguf (pip install moejax[gguf]) is not installed")
  from moejax.io.loader import init_random
  from tests.test_gguf import CFG, write_gguf
  path = str(tmp_path / "tiny.gguf")
  params, exps = init_random(CFG, seed=3, scale=0.05)
  write_gguf(path, params, exps)
  out = tmp_path / "bench.json"
  cmd = [sys.executable, "-m", "launch.bench_offload", f"--model_dir={path}", "--prompt_len=4",
         "--warmup_tokens=2", "--decode_tokens=4", "--rounds=2", "--presets=baseline",
         "--links=native", "--store=mmap", "--cache_fraction=0.5", f"--out={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["model"] == f"GGUF ({path})" and r["layers"] == 2
  # the blocks' bytes (tests/test_gguf.py: Q4_K/Q6_K in layer 0, Q8_0/Q4_0 in layer 1)
  l0, l1 = 256 * 144 * 2 + 256 * 210, 256 * 272 * 2 + 256 * 144
  assert r["expert_bytes"] == -(-(l0 + l1) // 2)
  assert r["memory"]["plans"]["baseline"]["expert_bytes"] == r["expert_bytes"]
  p = r["links"]["native"]["presets"]["baseline"]
  assert p["tpot_ms"] > 0 and p["stats"]["tokens"] == 4
