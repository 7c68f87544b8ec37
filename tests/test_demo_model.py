"""The shipped demo model: loads through moejax and, independently, through transformers."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from moejax.io.loader import load_model
from moejax.model.model import Transformer
from moejax.io.tokenizer import Tokenizer

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpts", "demo")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "config.json")),
                                reason="ckpts/demo not present")

CODE = "import os\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"


def test_demo_shape_and_budget():
  cfg, params, store = load_model(DEMO)
  assert cfg.model_type == "qwen3_moe" and cfg.num_layers >= 8
  assert cfg.num_experts >= 64 and cfg.top_k == 8 and cfg.norm_topk_prob
  assert cfg.moe_intermediate_size * 4 <= cfg.hidden_size * 1.5
  size = sum(os.path.getsize(os.path.join(DEMO, f)) for f in os.listdir(DEMO))
  assert size <= 24 * 2**20
  assert json.load(open(os.path.join(DEMO, "config.json")))["torch_dtype"] == "bfloat16"


def test_tokenizer_roundtrip():
  tok = Tokenizer(DEMO)
  ids = tok.encode(CODE)
  assert tok.decode(ids) == CODE and len(ids) < len(CODE) / 2   # BPE compresses code


def test_logits_match_transformers():
  tok = Tokenizer(DEMO)
  ids = tok.encode(CODE)
  cfg, params, store = load_model(DEMO, dtype=jnp.float32)
  ours, _, _ = Transformer(cfg).apply({"params": params}, jnp.array([ids]), store.to_device())
  ref = transformers.Qwen3MoeForCausalLM.from_pretrained(
      DEMO, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
  with torch.no_grad():
    theirs = ref(torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(np.asarray(ours[0]), theirs, atol=1e-4, rtol=0)
  # and the model has learned something: the next token of code is often the argmax
  acc = np.mean(np.argmax(theirs[:-1], -1) == np.array(ids[1:]))
  assert acc > 0.3, acc
