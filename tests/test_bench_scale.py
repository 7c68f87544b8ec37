"""launch.bench_scale (benchmarks.scale) without llama.cpp: its exit-2 paths and the moejax
child end to end."""

import json
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import pytest
from absl.testing import flagsaver

from benchmarks import memcg, scale as bench_scale, scale_disk
from moejax.io.loader import init_random, save_hf
from moejax.model.config import ModelConfig

# vocab 8192: the demo tokenizer's ids (the child decodes the held-out stream)
CFG = ModelConfig(model_type="qwen3_moe", vocab_size=8192, hidden_size=32, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, num_experts=16, top_k=2,
                  moe_intermediate_size=16, intermediate_size=64,
                  sparse_layers=(True, True), qk_norm="head").validate()


def run_main(tmp_path, *args):
  """bench_scale.main with these flags -> the SystemExit code (None: it returned)."""
  with flagsaver.flagsaver():
    bench_scale.FLAGS(["bench_scale", f"--model_root={tmp_path}", f"--gguf_dir={tmp_path}",
                       f"--out={tmp_path / 'out.json'}", *args])
    try:
      bench_scale.main([])
    except SystemExit as e:
      return e.code
  return None


def test_no_cgroup_exits_2_with_the_reason(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(memcg, "available", lambda: "memory cgroups need root (test)")
  assert run_main(tmp_path, "--layers=2") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["bench_scale: memory cgroups need root (test)"]
  assert not list(tmp_path.iterdir())           # nothing written


def test_too_small_limit_names_the_flag_and_the_smallest_value(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(memcg, "available", lambda: None)
  assert run_main(tmp_path, "--layers=24", "--memory_limit_gb=4") == 2
  line = capsys.readouterr().err.strip().splitlines()[0]
  assert "--memory_limit_gb=4 is below" in line
  smallest = line.rsplit("--memory_limit_gb=", 1)[1]
  with flagsaver.flagsaver(layers=24):
    plan, needs = bench_scale.plan_needs(24)
  assert float(smallest) * 1e9 >= needs > (float(smallest) - 0.1) * 1e9
  assert needs == plan["anon_bytes"] + 10**9
  # that value passes the check; the next one (disk space) then refuses, writing nothing
  monkeypatch.setattr(scale_disk.shutil, "disk_usage",
                      lambda p: types.SimpleNamespace(free=10**9))
  assert run_main(tmp_path, "--layers=24", f"--memory_limit_gb={smallest}") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "needs" in err[0] and "it has 1000000000" in err[0]
  assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  params, exps = init_random(CFG, seed=1, dtype=jnp.bfloat16)
  tok = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts",
                     "demo", "tokenizer.json")      # the stream is the held-out text
  save_hf(CFG, params, exps, str(d), layout="per_expert", dtype=jnp.bfloat16,
          tokenizer_json=tok)
  return str(d)


def test_moejax_child_prints_one_json_line(tiny_model):
  cmd = [sys.executable, "-m", "launch.bench_scale", "--child=moejax",
         f"--model_dir={tiny_model}", "--policy=quality", "--prompt_len=4",
         "--decode_tokens=4", "--warmup_tokens=1", "--max_len=32"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["policy"] == "quality" and r["decode_tokens"] == 4 and len(r["tokens"]) == 4
  # teacher-forced on the held-out stream, after the prompt and the warm-up token
  from benchmarks import stream
  assert r["tokens"] == stream.held_out_ids(os.path.join(tiny_model, "tokenizer.json"), 9)[5:9]
  assert r["routing"]["stream"]["tokens"] == 4 and r["routing"]["hit_rate"] is not None
  for k in ("load_s", "engine_s", "compile_s", "prefill_s", "decode_s", "decode_tok_s",
            "prefill_tok_s"):
    assert r[k] > 0, k
  assert r["decode_tok_s"] == pytest.approx(4 / r["decode_s"])
  assert r["decode_read_bytes"] >= 0 and r["decode_read_bytes_per_token"] >= 0
  assert r["peak_anon_bytes"] > 0 and r["plan"]["store"] == "mmap"
  assert r["plan"]["anon_bytes"] > 0 and r["plan"]["kv_len"] == 32
  assert 0 <= r["hit_rate"] <= 1 and r["fetches_per_token"] >= 0
  assert 0 <= r["substituted_call_pct"] <= 100 and r["stats"]["tokens"] == 4
