"""The CPU kernels' switch, build cache key, failure message and the decoding flag."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io.loader import init_random
from moejax.io.store import ExpertStore
from moejax.kernels import cpu_build, cpu_kernel, cpu_matmul, cpu_rows
from moejax.model import experts as experts_lib
from moejax.model import sampler as sampler_lib
from moejax.model.config import ModelConfig
from moejax.model.model import _take_bf16_as_u16

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason="no C++ compiler: the kernel is not built")

GCC = (' /usr/lib/gcc/x86_64-linux-gnu/12/cc1 -E -quiet -imultiarch x86_64-linux-gnu - '
       '"-march=znver3" -mmmx -mavx2 -mno-avx512er --param "l1-cache-size=32" '
       '"-mtune=znver3" -dumpbase -\nCOLLECT_GCC_OPTIONS=\'-march=native\' \'-E\'\n')
CLANG = (' "/usr/bin/clang-16" "-cc1" "-triple" "x86_64-pc-linux-gnu" "-E" '
         '"-mrelocation-model" "pic" "-target-cpu" "skylake" "-target-feature" "+avx2" '
         '"-target-feature" "-avx512f" "-tune-cpu" "generic" "-fdebug-compilation-dir=/x"\n')


@pytest.fixture
def fresh(monkeypatch):
  """cpu_kernel as in a new process (nothing tried, nothing loaded); restored after."""
  for key, value in (("loaded", None), ("lib", None), ("override", None), ("decoding", 0)):
    monkeypatch.setitem(cpu_kernel._state, key, value)
  monkeypatch.delenv("MOEJAX_CPU_KERNEL", raising=False)


def test_the_driver_output_gives_the_target_isa():
  assert cpu_build.isa_of_driver_output(GCC) == (
      "-march=znver3 -mmmx -mavx2 -mno-avx512er -mtune=znver3")
  assert cpu_build.isa_of_driver_output(CLANG) == (
      "-target-cpu skylake -target-feature +avx2 -target-feature -avx512f -tune-cpu generic")
  assert cpu_build.isa_of_driver_output("COLLECT_GCC_OPTIONS='-march=native'\n") == ""


def test_the_cache_path_is_keyed_by_the_isa(monkeypatch, tmp_path):
  monkeypatch.setenv("MOEJAX_CACHE", str(tmp_path))
  path = lambda src, isa: cpu_build.cache_path(src, ["c++"], "c++ 12.2", isa)
  a = path(b"src", "-march=znver3 -mavx512f")
  assert a == path(b"src", "-march=znver3 -mavx512f")
  assert a != path(b"src", "-march=haswell -mno-avx512f")
  assert a != path(b"src2", "-march=znver3 -mavx512f")
  assert os.path.dirname(a) == str(tmp_path)


@needs_kernel
def test_the_isa_of_this_machine_is_stable():
  cxx = cpu_build._compiler()
  isa = cpu_build.target_isa(cxx)
  assert isa and isa == cpu_build.target_isa(cxx) and "native" not in isa


def _embed_jaxpr():
  table = jnp.zeros((16, 8), jnp.bfloat16)
  return str(jax.make_jaxpr(lambda t, i: cpu_rows.take_rows(t, i, _take_bf16_as_u16))(
      table, jnp.zeros((1, 3), jnp.int32)))


def test_other_backends_never_build_and_embed_the_same_way(fresh, monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(cpu_build, "build", lambda: pytest.fail("built on a GPU host"))
  assert not cpu_kernel.available() and not cpu_kernel.set_spin_us(0)
  assert cpu_kernel._state["loaded"] is None and cpu_kernel._state["lib"] is None
  with_compiler = _embed_jaxpr()
  monkeypatch.setenv("CXX", "/nonexistent/c++")
  assert _embed_jaxpr() == with_compiler
  assert "ffi_call" not in with_compiler and "bitcast_convert_type" in with_compiler


@needs_kernel
def test_the_cpu_backend_embeds_with_the_kernel():
  assert "ffi_call" in _embed_jaxpr() and "bitcast_convert_type" not in _embed_jaxpr()


def test_the_switch_turns_the_kernels_off(fresh, monkeypatch):
  monkeypatch.setattr(cpu_build, "build", lambda: pytest.fail("built while switched off"))
  for value in ("0", "off", "False", " no "):
    monkeypatch.setenv("MOEJAX_CPU_KERNEL", value)
    assert not cpu_kernel.available()
  assert cpu_kernel._state["loaded"] is None


@needs_kernel
def test_the_switch_is_read_at_each_trace(monkeypatch):
  monkeypatch.setenv("MOEJAX_CPU_KERNEL", "0")
  assert not cpu_kernel.available()
  with cpu_kernel.enabled(True):
    assert cpu_kernel.available()
  monkeypatch.setenv("MOEJAX_CPU_KERNEL", "1")
  assert cpu_kernel.available()
  with cpu_kernel.enabled(False):
    assert not cpu_kernel.available()


def test_a_failed_build_says_one_line_once(fresh, monkeypatch, tmp_path, capsys):
  fake = tmp_path / "bad-c++"
  fake.write_text("#!/bin/sh\necho \"error: no such thing as $1\" >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv("CXX", str(fake))
  monkeypatch.setenv("MOEJAX_CACHE", str(tmp_path / "cache"))
  assert not cpu_kernel.available() and not cpu_kernel.available()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "failed to compile" in err[0] and "XLA's ops" in err[0], err
  (log,) = list((tmp_path / "cache").glob("*.log"))
  assert "error: no such thing" in log.read_text() and str(log) in err[0]


def test_no_compiler_gives_one_line_and_xla_ops(tmp_path):
  script = ("import jax, jax.numpy as jnp\n"
            "from moejax.kernels import cpu_kernel\n"
            "from moejax.model import layers\n"
            "x = jnp.ones((2, 4), jnp.bfloat16)\n"
            "y = jax.jit(lambda x: layers.rms_norm(x, jnp.ones(4, jnp.bfloat16), 1e-6))(x)\n"
            "print(cpu_kernel.available(), cpu_kernel.available(), float(y.sum()))\n")
  env = dict(os.environ, CXX="/nonexistent/c++", MOEJAX_CACHE=str(tmp_path),
             JAX_PLATFORMS="cpu")
  env.pop("MOEJAX_CPU_KERNEL", None)
  res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr
  assert res.stdout.split() == ["False", "False", "8.0"]
  assert "Traceback" not in res.stderr
  lines = [l for l in res.stderr.splitlines() if "moejax" in l]
  assert lines == ["[moejax] CPU kernels not built (no C++ compiler at "
                   "CXX='/nonexistent/c++'); using XLA's ops"], res.stderr


@needs_kernel
def test_helpers_spin_only_inside_decoding_and_give_the_same_bits():
  rng = np.random.default_rng(3)
  w = {"gate_up": jnp.asarray(rng.normal(size=(8, 64, 48)), jnp.bfloat16),
       "down": jnp.asarray(rng.normal(size=(8, 48, 32)), jnp.bfloat16)}
  ws = (jnp.asarray(rng.normal(size=(256, 48)), jnp.bfloat16),)
  fn = jax.jit(lambda x, ids, g: (experts_lib.apply_experts(x, ids, g, w),
                                  cpu_matmul.linears(x, ws)))
  args = [(jnp.asarray(rng.normal(size=(n, 48)), jnp.bfloat16),
           jnp.asarray(rng.integers(0, 8, (n, 2)), jnp.int32),
           jnp.asarray(rng.random((n, 2)), jnp.float32)) for n in (1, 3, 1, 2)]
  run = lambda: jax.device_get([fn(*a) for a in args])
  assert not cpu_kernel.is_decoding()
  outside = run()
  with cpu_kernel.decoding():
    assert cpu_kernel.is_decoding()
    with cpu_kernel.decoding():
      assert cpu_kernel.is_decoding()
    assert cpu_kernel.is_decoding()            # the outer loop still runs
    inside = run()
  assert not cpu_kernel.is_decoding()
  with pytest.raises(KeyError), cpu_kernel.decoding():
    raise KeyError("a loop that fails")
  assert not cpu_kernel.is_decoding()
  chex.assert_trees_all_equal(outside, inside)


@needs_kernel
def test_the_sampler_decodes_inside_decoding(monkeypatch):
  cfg = ModelConfig(model_type="qwen3_moe", vocab_size=50, hidden_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                    moe_intermediate_size=8, intermediate_size=64,
                    sparse_layers=(True, True), qk_norm="head").validate()
  params, exps = init_random(cfg, seed=1, scale=0.5)
  s = sampler_lib.Sampler(cfg, params, ExpertStore.from_stacked(exps).to_device(), max_len=32)
  seen = []
  sp = sampler_lib.SamplingParams(max_new_tokens=4)
  toks = s.generate([1, 2], sp, on_token=lambda _: seen.append(cpu_kernel.is_decoding()))
  assert seen == [True] * 4 and not cpu_kernel.is_decoding()
  loop = sampler_lib.decode_loop
  monkeypatch.setattr(sampler_lib, "decode_loop", lambda *a, **k: (
      seen.append(cpu_kernel.is_decoding()), loop(*a, **k))[1])
  assert s.generate_loop([1, 2], sp) == toks and seen[4:] == [True]
  assert not cpu_kernel.is_decoding()
