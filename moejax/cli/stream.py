"""Generated text to a stream as the tokens come (moejax-generate's stdout).

    out = TextStream(tok, sys.stdout, prefix=prompt)
    ids = sampler.generate(prompt_ids, sp, on_token=out.add)
    out.finish()            # what is left, and the newline

What reaches the stream is exactly `prefix + tok.decode(ids) + "\\n"`, the text
printed without streaming.  A token can hold part of a UTF-8 character (byte-level
vocabularies split multi-byte characters): the decoded text then ends in U+FFFD,
and those pieces wait until the character completes.  Each token decodes a
window that starts a few tokens back (as a detokenizer needs context for spaces),
so the cost per token does not grow with the text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
  """Writes the text of the tokens given to `add` as soon as it is final."""

  def __init__(self, tok, stream, prefix: str = "", context: int = 8):
    self.tok, self.stream, self.context = tok, stream, context
    self.ids: list[int] = []
    self._start = 0            # the window's first token
    self._shown = 0            # characters of the window's text already written
    self.closed = False
    self._write(prefix)

  def _write(self, text: str):
    if text:
      self.stream.write(text)
      self.stream.flush()

  def add(self, token_id: int):
    """One more generated token: writes whatever text it completes."""
    self.ids.append(int(token_id))
    text = self.tok.decode(self.ids[self._start:])
    if text.endswith(REPLACEMENT):      # an unfinished character: wait for its bytes
      return
    self._write(text[self._shown:])
    self._shown = len(text)
    if len(self.ids) - self._start > 2 * self.context:   # slide the window forward
      self._start = len(self.ids) - self.context
      self._shown = len(self.tok.decode(self.ids[self._start:]))

  def finish(self):
    """The rest (e.g. an unfinished character at the end, as U+FFFD) and the newline."""
    if self.closed:
      return
    self.closed = True
    self._write(self.tok.decode(self.ids[self._start:])[self._shown:] + "\n")

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.finish()     # also on Ctrl-C: the next line (e.g. "interrupted") starts a line
    return False
