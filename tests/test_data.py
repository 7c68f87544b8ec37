"""Corpus split, tokenizer and batching: deterministic and disjoint."""

import chex
import numpy as np

from moejax.train import data


def _fake_stdlib(root):
  for rel in ["a.py", "b/c.py", "b/d.py", "site-packages/x.py", "e.txt"] + [f"m{i}.py" for i in range(60)]:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"def f_{rel.replace('/', '_').replace('.', '_')}():\n    return 1\n")
  return str(root)


def test_split_is_deterministic_disjoint_and_skips_site_packages(tmp_path):
  root = _fake_stdlib(tmp_path)
  _, files = data.stdlib_files(root)
  assert "site-packages/x.py" not in files and "e.txt" not in files
  assert len(files) == 63
  held = [f for f in files if data.is_heldout(f)]
  assert 0 < len(held) < len(files) // 4
  # the rule depends only on the path
  assert [data.is_heldout(f) for f in files] == [data.is_heldout(f) for f in list(files)]
  tr, he, man = data.split_corpus(root)
  assert len(tr) + len(he) == 63 and len(he) == len(held)
  assert man["num_files"] == 63 and len(man["file_list_sha256"]) == 64


def test_tokenizer_roundtrip_and_stream(tmp_path):
  texts = ["def add(a, b):\n    return a + b\n"] * 20 + ["class A:\n    pass\n"] * 20
  tok = data.train_tokenizer(texts, vocab_size=300)
  s = "def add(x, y):\n\treturn x + y  # sum\n"
  assert tok.decode(tok.encode(s).ids) == s            # byte-level: lossless
  stream = data.encode_stream(tok, texts[:2])
  eot = tok.token_to_id(data.EOT)
  assert stream.dtype == np.uint16 and int((stream == eot).sum()) == 2 and stream[-1] == eot


def test_window_batches_are_a_pure_function_of_the_step():
  stream = np.arange(1000, dtype=np.uint16)
  order = data.window_order(stream.size, 10, seed=3)
  b5 = data.window_batch(stream, order, 5, 4, 10)
  chex.assert_shape(b5, (4, 11))
  np.testing.assert_array_equal(b5, data.window_batch(stream, data.window_order(1000, 10, 3), 5, 4, 10))
  np.testing.assert_array_equal(b5[:, 1:], b5[:, :-1] + 1)      # contiguous windows + shift
  assert not np.array_equal(b5, data.window_batch(stream, order, 6, 4, 10))


def test_humaneval_texts_come_from_the_package():
  texts = data.humaneval_texts()
  assert len(texts) == 164 and all("def " in t for t in texts)
