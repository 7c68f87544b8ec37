"""A GGUF file's tokenizer from its metadata (when no tokenizer.json lies beside it).

llama.cpp's converter writes a Hugging Face byte-level BPE tokenizer as
``tokenizer.ggml.model = "gpt2"`` with the vocabulary (``tokens``, in id order), each
token's type (``token_type``: 1 normal, 3 control, 4 user-defined, ...), the merges
("a b", in rank order), the bos/eos ids and ``tokenizer.ggml.pre``, the name of the
pre-tokenizer (the regex that splits text into words before BPE).  `from_gguf` rebuilds
the `tokenizers.Tokenizer` that tokenizer.json would give: a BPE model of vocab and merges,
the pre-tokenizer `PRE` names, the byte-level decoder, and the control / user-defined
tokens as added tokens (control ones special, so that decoding skips them).

A tokenizer model other than gpt2 or a pre-tokenizer `PRE` does not hold gets one line
naming it and the way out (a tokenizer.json beside the file): `GGUFUnsupported`, exit 2.
"""

from __future__ import annotations

from moejax.io.weights.gguf_file import GGUFUnsupported, _meta, _reader

# the Qwen2 family's split (transformers' Qwen2 tokenizer.json, llama.cpp's "qwen2")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE = ("gpt-2", "qwen2")          # tokenizer.ggml.pre values rebuilt here
CONTROL, USER_DEFINED = 3, 4      # gguf.TokenType


def _pre_tokenizer(pre: str):
  """(normalizer or None, pre-tokenizer) of llama.cpp's pre-tokenizer name `pre`."""
  from tokenizers import Regex, normalizers, pre_tokenizers
  if pre == "gpt-2":     # ByteLevel's own regex is GPT-2's
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  return normalizers.NFC(), pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def from_gguf(path: str):
  """The `tokenizers.Tokenizer` of GGUF file `path`'s tokenizer.ggml.* metadata."""
  reader = _reader(path)
  model = _meta(reader, "tokenizer.ggml.model")
  beside = "or put the model's tokenizer.json beside the file"
  if model is None:
    raise GGUFUnsupported(f"{path}: the GGUF holds no tokenizer (no tokenizer.ggml.model); "
                          f"put the model's tokenizer.json beside the file")
  if model != "gpt2":
    raise GGUFUnsupported(f"{path}: GGUF tokenizer model '{model}' is not one moejax builds "
                          f"(it builds gpt2, byte-level BPE); {beside}")
  pre = _meta(reader, "tokenizer.ggml.pre", "gpt-2")
  if pre not in PRE:
    raise GGUFUnsupported(f"{path}: GGUF pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not one "
                          f"moejax builds ({', '.join(PRE)}); {beside}")
  tokens = list(_meta(reader, "tokenizer.ggml.tokens"))
  kinds = list(_meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges", [])]
  from tokenizers import AddedToken, Tokenizer, decoders, models
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                             byte_fallback=False))
  normalizer, tok.pre_tokenizer = _pre_tokenizer(pre)
  if normalizer is not None:
    tok.normalizer = normalizer
  tok.decoder = decoders.ByteLevel()
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, k in zip(tokens, kinds) if k == USER_DEFINED])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, kinds) if k == CONTROL])
  return tok
