"""Tokenizer from a model folder's tokenizer.json (the `tokenizers` library), or of a GGUF
file: the tokenizer.json beside it when there is one, else its metadata
(moejax.io.weights.gguf_tokenizer)."""

from __future__ import annotations

import os


class TokenizerError(ValueError):
  pass


class Tokenizer:
  def __init__(self, path: str):
    from tokenizers import Tokenizer as _Tok
    if path.endswith(".gguf") and os.path.isfile(path):
      from moejax.io.weights import gguf_file, gguf_tokenizer
      beside = gguf_file.tokenizer_path(path)
      if beside is None:
        self._tok, self.path = gguf_tokenizer.from_gguf(path), path
        return
      path = beside
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
      raise TokenizerError(f"{path}: no such file (the model folder needs a tokenizer.json)")
    try:
      self._tok = _Tok.from_file(path)
    except Exception as e:  # the library raises a bare Exception on bad JSON
      raise TokenizerError(f"{path}: cannot read tokenizer ({e})") from None
    self.path = path

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=True)

  def token_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)


class ByteTokenizer:
  """Stand-in for random-weight models: UTF-8 bytes are the token ids."""
  vocab_size = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: list[int]) -> str:
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

  def token_id(self, token: str) -> int | None:
    return None
