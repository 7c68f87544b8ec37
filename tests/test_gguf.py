"""GGUF read in place (moejax.io.weights.gguf_file): a 2-layer qwen3moe written by gguf-py's
GGUFWriter with every tensor type moejax reads, against the same weights as safetensors;
the one-line refusals of an unknown architecture or tensor type."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf (pip install moejax[gguf]) is not installed")
from gguf import GGMLQuantizationType as T  # noqa: E402

from moejax.ggml import blocks  # noqa: E402
from moejax.io.loader import init_random, load_model, save_hf  # noqa: E402
from moejax.io.weights import gguf_file  # noqa: E402
from moejax.model.config import ModelConfig  # noqa: E402
from moejax.kernels import cpu_kernel  # noqa: E402
from moejax.model.sampler import Sampler, SamplingParams  # noqa: E402

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, num_experts=4, top_k=2,
                  moe_intermediate_size=256, intermediate_size=512,
                  sparse_layers=(True, True), qk_norm="head", rope_theta=10000.0,
                  max_position_embeddings=64)
# every type moejax reads, spread over the tensors (per layer: q, k, v, o, gate, up, down)
LAYER_TYPES = [dict(attn_q="Q4_0", attn_k="Q4_K", attn_v="BF16", attn_output="F16",
                    ffn_gate_exps="Q4_K", ffn_up_exps="Q4_K", ffn_down_exps="Q6_K"),
               dict(attn_q="Q8_0", attn_k="Q6_K", attn_v="Q4_0", attn_output="Q4_K",
                    ffn_gate_exps="Q8_0", ffn_up_exps="Q8_0", ffn_down_exps="Q4_0")]
TOP_TYPES = {"token_embd.weight": "Q6_K", "output.weight": "Q8_0", "output_norm.weight": "F32"}
HF = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}


def _encode(a, t):
  """(data, raw_dtype) for GGUFWriter.add_tensor, and the values it holds (f32)."""
  a = np.asarray(a, np.float32)
  if t == "F32":
    return a, None, a
  if t == "F16":
    return a.astype(np.float16), None, a.astype(np.float16).astype(np.float32)
  if t == "BF16":
    b = gguf.quants.quantize(a, T.BF16)
    return b, T.BF16, gguf.quants.dequantize(b, T.BF16)
  b = blocks.quantize(a, t.lower())
  return b, getattr(T, t), blocks.dequantize(b, t.lower())


def tokenizer_meta(tok_json: str, pre: str = "gpt-2", model: str = "gpt2") -> tuple:
  """The tokenizer.ggml.* metadata llama.cpp's converter writes for a byte-level BPE
  tokenizer.json, as (GGUFWriter add_ method, value) rows of `write_gguf`'s table."""
  import json
  t = json.load(open(tok_json))
  vocab = t["model"]["vocab"]
  tokens = sorted(vocab, key=vocab.get)
  control = {a["content"] for a in t["added_tokens"] if a["special"]}
  kinds = [gguf.TokenType.CONTROL if x in control else gguf.TokenType.NORMAL for x in tokens]
  merges = [m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]]
  return (("tokenizer_model", model), ("tokenizer_pre", pre), ("token_list", tokens),
          ("token_types", kinds), ("token_merges", merges),
          ("bos_token_id", vocab["<|endoftext|>"]), ("eos_token_id", vocab["<|endoftext|>"]))


def write_gguf(path, params, exps, arch="qwen3moe", meta=()):
  """A GGUF of the model (and the metadata rows `meta`); returns the values each tensor
  holds, as the HF layout."""
  w = gguf.GGUFWriter(path, arch)
  for key, value in tuple(meta) + (("block_count", CFG.num_layers),
                     ("context_length", CFG.max_position_embeddings),
                     ("embedding_length", CFG.hidden_size),
                     ("feed_forward_length", CFG.intermediate_size),
                     ("head_count", CFG.num_heads), ("head_count_kv", CFG.num_kv_heads),
                     ("key_length", CFG.head_dim), ("value_length", CFG.head_dim),
                     ("rope_freq_base", CFG.rope_theta),
                     ("layer_norm_rms_eps", CFG.rms_norm_eps),
                     ("expert_count", CFG.num_experts), ("expert_used_count", CFG.top_k),
                     ("expert_feed_forward_length", CFG.moe_intermediate_size)):
    getattr(w, f"add_{key}")(value)
  held_params, held_exps = {}, []

  def add(name, a, t):
    data, raw, vals = _encode(a, t)
    w.add_tensor(name, data, raw_dtype=raw)
    return vals

  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  held_params["embed_tokens"] = {"embedding": add("token_embd.weight",
                                                  f32(params["embed_tokens"]["embedding"]),
                                                  TOP_TYPES["token_embd.weight"])}
  held_params["norm"] = {"weight": add("output_norm.weight", f32(params["norm"]["weight"]), "F32")}
  held_params["lm_head"] = {"weight": add("output.weight", f32(params["lm_head"]["weight"]),
                                          TOP_TYPES["output.weight"])}
  for i in range(CFG.num_layers):
    p, lt, out = params[f"layers_{i}"], LAYER_TYPES[i], {}
    out["input_layernorm"] = {"weight": add(f"blk.{i}.attn_norm.weight",
                                            f32(p["input_layernorm"]["weight"]), "F32")}
    out["post_attention_layernorm"] = {"weight": add(
        f"blk.{i}.ffn_norm.weight", f32(p["post_attention_layernorm"]["weight"]), "F32")}
    att = {}
    for g, h in HF.items():
      att[h] = {"weight": add(f"blk.{i}.{g}.weight", f32(p["self_attn"][h]["weight"]), lt[g])}
    for g, h in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
      att[h] = {"weight": add(f"blk.{i}.{g}.weight", f32(p["self_attn"][h]["weight"]), "F32")}
    out["self_attn"] = att
    out["mlp"] = {"gate": {"weight": add(f"blk.{i}.ffn_gate_inp.weight",
                                         f32(p["mlp"]["gate"]["weight"]), "F32")}}
    half = CFG.moe_intermediate_size
    gu, dn = f32(exps[i]["gate_up"]), f32(exps[i]["down"])
    g = add(f"blk.{i}.ffn_gate_exps.weight", gu[:, :half], lt["ffn_gate_exps"])
    u = add(f"blk.{i}.ffn_up_exps.weight", gu[:, half:], lt["ffn_up_exps"])
    d = add(f"blk.{i}.ffn_down_exps.weight", dn, lt["ffn_down_exps"])
    held_exps.append({"gate_up": np.concatenate([g, u], axis=1), "down": d})
    held_params[f"layers_{i}"] = out
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return held_params, held_exps


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("gguf")
  params, exps = init_random(CFG, seed=3, scale=0.05)
  path = str(tmp / "tiny.gguf")
  held_params, held_exps = write_gguf(path, params, exps)
  save_hf(CFG, held_params, held_exps, str(tmp / "hf"))   # the same values, as safetensors
  return path, str(tmp / "hf")


@pytest.mark.parametrize("mmap", [False, True])
def test_gguf_matches_the_safetensors_path(files, mmap):
  path, hf = files
  cfg, params, store = load_model(path, dtype=jnp.float32, mmap=mmap)
  assert cfg.num_layers == 2 and cfg.sparse_layers == (True, True) and cfg.head_dim == 64
  assert not cfg.tie_word_embeddings and cfg.norm_topk_prob
  q = params["layers_0"]["self_attn"]["q_proj"]["weight"]
  assert q.qtype == "q4_0" and q.shape == (256, 256)
  assert sorted(store.stacked(0)) == ["down@q6_k", "gate@q4_k", "up@q4_k"]
  assert store.expert_nbytes(0) == 256 * 144 * 2 + 256 * 210
  cfg2, params2, store2 = load_model(hf, dtype=jnp.float32)
  prompt = np.array([[1, 7, 3, 9, 4, 2]])
  b = Sampler(cfg2, params2, store2.device_experts(jnp.float32), max_len=16)
  lb = np.asarray(b.prefill(prompt)[0])
  # XLA dequantizes the blocks: the same values, the same logits
  with cpu_kernel.enabled(False):
    a = Sampler(cfg, params, store.device_experts(jnp.float32), max_len=16)
    la = np.asarray(a.prefill(prompt)[0])
    sp = SamplingParams(max_new_tokens=6)
    assert a.generate([1, 7, 3], sp) == b.generate([1, 7, 3], sp)
  np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-4)
  # the CPU kernels compute on the blocks with the activations rounded to 8 bits a block, as
  # ggml does (their bound: tests/test_cpu_quant.py); another max_len: another compile
  k = Sampler(cfg, params, store.device_experts(jnp.float32), max_len=24)
  lk = np.asarray(k.prefill(prompt)[0])
  np.testing.assert_allclose(lk, lb, atol=0.05 * np.abs(lb).max())


def test_unknown_architecture_is_refused_by_name(files, tmp_path):
  params, exps = init_random(CFG, seed=3, scale=0.05)
  path = str(tmp_path / "llama.gguf")
  write_gguf(path, params, exps, arch="llama")
  with pytest.raises(gguf_file.GGUFUnsupported, match="architecture 'llama' is not one"):
    load_model(path)


def test_unknown_tensor_type_is_refused_by_name(tmp_path):
  params, exps = init_random(CFG, seed=3, scale=0.05)
  path = str(tmp_path / "q5k.gguf")
  writer_add = gguf.GGUFWriter.add_tensor

  def add_tensor(self, name, tensor, *a, **kw):   # one tensor's bytes as Q5_K (176 a block)
    if name == "blk.1.attn_k.weight":
      return writer_add(self, name, np.zeros((256, 176), np.uint8), raw_dtype=T.Q5_K)
    return writer_add(self, name, tensor, *a, **kw)

  gguf.GGUFWriter.add_tensor = add_tensor
  try:
    write_gguf(path, params, exps)
  finally:
    gguf.GGUFWriter.add_tensor = writer_add
  with pytest.raises(gguf_file.GGUFUnsupported,
                     match="tensor 'blk.1.attn_k.weight' has type Q5_K, which moejax"):
    load_model(path)


@pytest.mark.parametrize("mmap", [False, True])
def test_engine_runs_layers_of_different_expert_formats(files, mmap):
  """A Q4_K_M file's layers hold their experts in different tensors ("down@q6_k" here,
  "down@q4_0" there): each layer's slots are its own (`initial.expert_spec`), the layers
  unrolled; baseline at 25% fetches into them and gives the Sampler's tokens."""
  from moejax.offload.config import EngineConfig
  from moejax.offload.engine import OffloadEngine
  cfg, params, store = load_model(files[0], dtype=jnp.float32, mmap=mmap)
  assert sorted(store.stacked(0)) != sorted(store.stacked(1))     # mixed per layer
  sizes = [store.expert_nbytes(l) for l in (0, 1)]
  assert sizes[0] != sizes[1] and store.expert_nbytes() == -(-sum(sizes) // 2)
  sp = SamplingParams(max_new_tokens=8)
  want = Sampler(cfg, params, store.device_experts(jnp.float32), max_len=32).generate(
      [1, 7, 3], sp)
  config = EngineConfig.make("baseline", cache_fraction=0.25, max_len=32)
  with OffloadEngine(cfg, params, store, config) as eng:
    assert not eng.budget.all_resident and not eng.program.scan
    assert sorted(eng.states[1].buffers) == ["down@q4_0", "gate@q8_0", "up@q8_0"]
    assert eng.generate([1, 7, 3], sp) == want
    assert eng.stats()["fetches_per_token"] > 0


DEMO_TOK = os.path.join(os.path.dirname(__file__), "..", "ckpts", "demo", "tokenizer.json")
TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
         "  leading and   inner  spaces\t\ttabs\n\n\nand blank lines  ",
         "naïve café — Größe, 東京, emoji 🚀 and ümlauts", "x<|endoftext|>y", "it's 12345 o'clock"]


def _tokenizer_gguf(path, meta):
  """A GGUF of metadata alone (the tokenizer reads nothing else)."""
  w = gguf.GGUFWriter(path, "qwen3moe")
  for key, value in meta:
    getattr(w, f"add_{key}")(value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.close()


@pytest.mark.skipif(not os.path.exists(DEMO_TOK), reason="the demo model is not in ckpts/demo")
@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_tokenizer_from_metadata_matches_tokenizer_json(tmp_path, pre):
  """The GGUF's tokenizer.ggml.* metadata gives the tokenizer.json's ids and text: gpt-2 is
  the demo's own (ByteLevel's regex); qwen2 against the demo's vocabulary with transformers'
  Qwen2 pre-tokenizer (NFC, the Qwen2 split, ByteLevel without its regex) in the JSON."""
  import json
  from tokenizers import Tokenizer as HF
  from moejax.io.tokenizer import Tokenizer
  t = json.load(open(DEMO_TOK))
  if pre == "qwen2":
    t["normalizer"] = {"type": "NFC"}
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": gguf_tokenizer_regex()}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}
  ref = HF.from_str(json.dumps(t))
  path = str(tmp_path / "tok.gguf")
  _tokenizer_gguf(path, tokenizer_meta(DEMO_TOK, pre))
  tok = Tokenizer(path)
  assert tok.path == path and tok.vocab_size == ref.get_vocab_size() == 8192
  assert tok.token_id("<|endoftext|>") == 0
  for text in TEXTS + ["cafe\u0301 (NFD)"]:
    want = ref.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == want, text
    assert tok.decode(want) == ref.decode(want, skip_special_tokens=True)
  assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]
  assert tok.encode("x<|endoftext|>y")[1] == 0 and "endoftext" not in tok.decode([5, 0, 6])
  # a tokenizer.json beside the file is preferred
  with open(tmp_path / "tokenizer.json", "w") as f:
    json.dump(t, f)
  assert Tokenizer(path).path == str(tmp_path / "tokenizer.json")


def gguf_tokenizer_regex():
  from moejax.io.weights.gguf_tokenizer import QWEN2_REGEX
  return QWEN2_REGEX


@pytest.mark.skipif(not os.path.exists(DEMO_TOK), reason="the demo model is not in ckpts/demo")
@pytest.mark.parametrize("model,pre,match", [
    ("llama", "default", "tokenizer model 'llama' is not one moejax builds"),
    ("gpt2", "deepseek-llm", "pre-tokenizer 'deepseek-llm' .* is not one moejax builds")])
def test_unsupported_gguf_tokenizer_is_refused_by_name(tmp_path, model, pre, match):
  from moejax.io.tokenizer import Tokenizer
  path = str(tmp_path / "tok.gguf")
  _tokenizer_gguf(path, tokenizer_meta(DEMO_TOK, pre, model))
  with pytest.raises(gguf_file.GGUFUnsupported, match=match):
    Tokenizer(path)
