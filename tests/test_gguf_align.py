"""A GGUF whose tensor data starts at 32 mod 64 bytes, as llama.cpp writes them (issue 61):
jax cannot map it in place, and it must not be copied into RAM behind the memory plan's
back.  The offload engine reads each fetched expert from the file (`staging.read_through`)
and gives the aligned file's logits with the plan's anonymous memory; every expert
resident copies it with a warning line; `moejax-align-gguf` (`gguf_align.align`) rewrites
it aligned, tensors unchanged."""

import ctypes
import dataclasses
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf (pip install moejax[gguf]) is not installed")
from gguf import GGMLQuantizationType as T  # noqa: E402

from moejax.io import repack  # noqa: E402
from moejax.io import store as store_lib  # noqa: E402
from moejax.io.loader import init_random, load_model  # noqa: E402
from moejax.io.weights import gguf_align, gguf_file  # noqa: E402
from moejax.model.config import ModelConfig  # noqa: E402
from moejax.model.sampler import SamplingParams  # noqa: E402
from tests.test_gguf import CFG, write_gguf  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# wide enough that a copy of the experts (2 x 128 x 3 x 512 rows x 544 B of Q8_0: 214 MB)
# stands far above what a run holds besides (its slots, params and compile: ~100 MB)
BIG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=512, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, num_experts=128, top_k=2,
                  moe_intermediate_size=512, intermediate_size=512, sparse_layers=(True, True),
                  qk_norm="head", max_position_embeddings=64)


def _expert_offsets(path) -> set:
  r = gguf.GGUFReader(path)
  return {t.data.ctypes.data % 64 for t in r.tensors if "_exps" in t.name}


def at_32_mod_64(write, path):
  """write(path, name), again with general.name 32 bytes longer if the experts' data did
  not start at 32 mod 64 bytes (llama.cpp's usual offset; the tensors are padded to 32)."""
  write(path, "m")
  if _expert_offsets(path) == {0}:
    write(path, "m" * 33)
  assert _expert_offsets(path) == {32}
  return path


def _q8_blocks(shape, rng) -> np.ndarray:
  """Q8_0 blocks of `shape` (values) made directly: an f16 scale and 32 int8 each."""
  n = int(np.prod(shape)) // 32
  b = np.frombuffer(rng.bytes(n * 34), np.uint8).reshape(n, 34).copy()
  b[:, :2] = np.full((n, 1), 0.002, np.float16).view(np.uint8)
  return b.reshape(shape[:-1] + (shape[-1] // 32 * 34,))


def write_big(path, name):
  """BIG as a GGUF: float dense tensors, Q8_0 experts of random blocks."""
  cfg, rng = BIG, np.random.default_rng(0)
  params, _ = init_random(dataclasses.replace(cfg, moe_intermediate_size=32), seed=1,
                          scale=0.05)          # the experts' width: not in the params
  w = gguf.GGUFWriter(path, "qwen3moe")
  w.add_name(name)
  for k, v in (("block_count", 2), ("context_length", 64), ("embedding_length", 512),
               ("feed_forward_length", 512), ("head_count", 4), ("head_count_kv", 2),
               ("key_length", 64), ("value_length", 64), ("rope_freq_base", 10000.0),
               ("layer_norm_rms_eps", 1e-6), ("expert_count", cfg.num_experts),
               ("expert_used_count", 2), ("expert_feed_forward_length", 512)):
    getattr(w, f"add_{k}")(v)
  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  w.add_tensor("token_embd.weight", f32(params["embed_tokens"]["embedding"]))
  w.add_tensor("output_norm.weight", f32(params["norm"]["weight"]))
  w.add_tensor("output.weight", f32(params["lm_head"]["weight"]))
  attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
          "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
  for i in range(2):
    p = params[f"layers_{i}"]
    w.add_tensor(f"blk.{i}.attn_norm.weight", f32(p["input_layernorm"]["weight"]))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", f32(p["post_attention_layernorm"]["weight"]))
    for g, h in attn.items():
      w.add_tensor(f"blk.{i}.{g}.weight", f32(p["self_attn"][h]["weight"]))
    w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", f32(p["mlp"]["gate"]["weight"]))
    for g in ("gate", "up", "down"):
      w.add_tensor(f"blk.{i}.ffn_{g}_exps.weight", _q8_blocks((cfg.num_experts, 512, 512), rng),
                   raw_dtype=T.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def write_tiny(path, name):
  """tests/test_gguf.py's 2-layer file (its layers in different expert formats)."""
  write_gguf(path, *init_random(CFG, seed=3, scale=0.05), meta=(("name", name),))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return at_32_mod_64(write_tiny, str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def test_align_moves_the_data_and_keeps_every_tensor(tiny, tmp_path):
  before = {t.name: np.array(t.data) for t in gguf.GGUFReader(tiny).tensors}
  size = os.path.getsize(tiny)
  assert gguf_align.offset(tiny) == 32
  out = str(tmp_path / "copy.gguf")
  shifts = [gguf_align.align(tiny, out=out)]                # a new file: the source kept
  assert gguf_align.offset(tiny) == 32 and gguf_align.offset(out) == 0
  path = str(tmp_path / "inplace.gguf")
  with open(tiny, "rb") as src, open(path, "wb") as dst:
    dst.write(src.read())
  shifts.append(gguf_align.align(path, to=4096))            # in place, to a page
  assert gguf.GGUFReader(path).data_offset % 4096 == 0
  for p, shift in zip((out, path), shifts):
    r = gguf.GGUFReader(p)
    assert shift % 32 == 0 and os.path.getsize(p) == size + shift
    assert str(r.get_field(gguf_align.PAD_KEY).contents()).strip() == ""
    assert r.get_field("general.architecture").contents() == "qwen3moe"
    assert {t.name for t in r.tensors} == set(before)
    for t in r.tensors:
      np.testing.assert_array_equal(np.array(t.data), before[t.name])
  assert gguf_align.align(path, to=4096) == 0               # once


def test_align_console_program_rewrites_in_place(tiny, tmp_path):
  path = str(tmp_path / "user.gguf")
  with open(tiny, "rb") as src, open(path, "wb") as dst:
    dst.write(src.read())
  run = lambda *a: subprocess.run([sys.executable, "-m", "moejax.cli.prepare.align_gguf", *a],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)
  p = run(f"--model_dir={path}")
  assert p.returncode == 0, p.stderr
  assert "moved by" in p.stdout and gguf_align.offset(path) == 0
  p = run(f"--model_dir={path}")
  assert p.returncode == 0 and "nothing to do" in p.stdout, p.stderr
  p = run(f"--model_dir={tmp_path / 'none.gguf'}")
  assert p.returncode == 2 and "no such GGUF file" in p.stderr


def test_misaligned_file_in_ram_is_aligned_and_resident_copy_is_announced(tiny, capsys):
  # --store=numpy: one copy into RAM at jax's alignment, also for layers of other formats
  _, _, store = load_model(tiny, mmap=False)
  assert store_lib.unaligned_bytes(store) == 0
  # --store=mmap with every expert resident: a copy, said in one line naming the file
  _, _, store = load_model(tiny, mmap=True)
  assert store_lib.unaligned_bytes(store) == sum(
      v.nbytes for l in store.moe_layers for v in store.stacked(l).values())
  store.device_experts(jnp.float32)
  err = capsys.readouterr().err
  assert f"{tiny}: " in err and "copied into RAM" in err
  assert f"moejax-align-gguf --model_dir={tiny}" in err


def _anon_mb() -> float:
  ctypes.CDLL("libc.so.6").malloc_trim(0)      # freed heap back, so that growth is held memory
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) / 1024


def _engine_run(path):
  """(prefill + 3 decode steps' logits, RssAnon growth in MB, the engine's stats, the
  store's expert bytes) of the baseline preset at 25% on the mapped file."""
  from moejax.offload.config import EngineConfig
  from moejax.offload.engine import OffloadEngine
  a0 = _anon_mb()
  cfg, params, store = load_model(path, dtype=jnp.float32, mmap=True)
  config = EngineConfig.make("baseline", cache_fraction=0.25, max_len=32)
  with OffloadEngine(cfg, params, store, config) as eng:
    logits = [np.asarray(eng.prefill([1, 7, 3]))]
    logits += [np.asarray(eng.decode_step(t)) for t in (5, 9, 2)]
    grown = _anon_mb() - a0
    stats = eng.stats()
  n = sum(v.nbytes for l in store.moe_layers for v in store.stacked(l).values())
  return logits, grown, stats, n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon: Linux /proc")
def test_engine_reads_a_misaligned_file_in_place_within_the_plan(tmp_path, capsys):
  from moejax.offload import memory
  mis = at_32_mod_64(write_big, str(tmp_path / "user.gguf"))
  ok = str(tmp_path / "aligned.gguf")
  gguf_align.align(mis, out=ok)
  assert _expert_offsets(ok) == {0}
  want, _, _, _ = _engine_run(ok)           # first: its compiles do not count below
  assert "start off jax's 64-byte alignment" not in capsys.readouterr().err
  got, grown, stats, experts = _engine_run(mis)
  err = capsys.readouterr().err
  reader, _ = gguf_file.tensor_info(mis)
  plan = memory.plan_memory(gguf_file.read_config(reader, mis), jnp.float32, store="mmap",
                            cache_fraction=0.25, kv_len=32, nbytes=gguf_file.nbytes(reader))
  # the plan's anonymous memory (slots, params, KV; measured 91 MB against its 63 MB, the
  # rest compiles) and never the experts' copy (214 MB)
  assert experts > 200e6 and grown * 1e6 < plan.anon_bytes + experts / 2, (grown, plan.anon_bytes)
  for a, b in zip(want, got):               # the same bytes in the slots: the same logits
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
  assert stats["disk_reads"] > 0 and stats["staging_rows"] == 0
  assert f"{mis}: 0.21 GB of experts start off" in err and "read from the file" in err
  assert f"moejax-align-gguf --model_dir={mis}" in err
  assert repack.JAX_ALIGN == gguf_align.ALIGN


def test_host_policy_copies_a_misaligned_store_and_says_how_to_avoid_it(tiny, capsys):
  """--policy=host computes misses from the store where it lives: no read-through tier;
  the copy is one warning line that names the fix."""
  from moejax.offload.config import EngineConfig
  from moejax.offload.engine import OffloadEngine
  cfg, params, store = load_model(tiny, dtype=jnp.float32, mmap=True)
  config = EngineConfig.make("host", cache_fraction=0.5, max_len=16)
  with OffloadEngine(cfg, params, store, config) as eng:
    assert eng.staging is None
    assert len(eng.generate([1, 7, 3], SamplingParams(max_new_tokens=2))) == 2
  err = capsys.readouterr().err
  assert "of the mapped expert store was copied into RAM" in err
  assert f"moejax-align-gguf --model_dir={tiny}" in err


def test_the_plan_counts_the_copy_a_misaligned_file_makes(tiny, tmp_path):
  """Every expert resident (or --policy=host) on a mapped GGUF off the 64-byte boundary
  copies the experts into RAM: the printed plan counts them as anonymous memory and names
  the fix; other policies (read-through) and an aligned file keep them in the page cache."""
  from moejax.offload import memory
  ok = str(tmp_path / "aligned.gguf")
  gguf_align.align(tiny, out=ok)
  assert gguf_align.copied_whole(tiny, "mmap", None)
  assert gguf_align.copied_whole(tiny, "mmap", "host")
  assert not gguf_align.copied_whole(tiny, "mmap", "quality")
  assert not gguf_align.copied_whole(tiny, "numpy", None)
  assert not gguf_align.copied_whole(ok, "mmap", None)
  reader, _ = gguf_file.tensor_info(tiny)
  cfg, nb = gguf_file.read_config(reader, tiny), gguf_file.nbytes(reader)
  plan = lambda copied: memory.plan_memory(cfg, jnp.float32, store="mmap", offload=False,
                                           kv_len=32, nbytes=nb, store_copied=copied)
  mapped, copied = plan(False), plan(True)
  assert copied.anon_bytes == mapped.anon_bytes + mapped.all_experts_bytes > 0
  assert copied.page_cache_bytes == mapped.page_cache_bytes   # read once from the file
  assert "moejax-align-gguf" in copied.lines()[0] and "moejax-align-gguf" not in mapped.lines()[0]
  # the anonymous memory an all-resident load of the file really holds: the copy
  _, _, store = load_model(tiny, mmap=True)
  assert store_lib.unaligned_bytes(store) == mapped.all_experts_bytes
