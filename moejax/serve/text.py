"""The text of generated tokens as it becomes final, cut at the first stop sequence.

    text = StopText(tok, stops=["\\n\\n"])
    delta = text.add(token_id)     # new text to send ('' while a character or a possible
    if text.stopped: ...           #   stop sequence is unfinished); stopped: a stop matched
    rest = text.finish()           # what was held back, at the end

What is sent in total is `tok.decode(ids)` up to (not including) the first stop
sequence, or all of it.  A token can hold part of a UTF-8 character: the decoded text
then ends in U+FFFD and waits for the rest.  The last len(longest stop) - 1 characters
wait too, since they may begin a stop sequence.  Each token decodes a window that starts
a few tokens back, so the cost per token does not grow with the text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StopText:

  def __init__(self, tok, stops=(), context: int = 8):
    self.tok, self.context = tok, context
    self.stops = [s for s in stops if s]
    self.hold = max((len(s) for s in self.stops), default=1) - 1
    self.ids: list[int] = []
    self._start = 0        # the decode window's first token
    self._base = ""        # the text of the tokens before the window
    self.text = ""         # the final text so far (stop sequences not cut yet)
    self.sent = 0          # characters of `text` sent
    self.stopped = False

  def add(self, token_id: int) -> str:
    """One more token: the text it makes safe to send."""
    if self.stopped:
      return ""
    self.ids.append(int(token_id))
    window = self.tok.decode(self.ids[self._start:])
    if window.endswith(REPLACEMENT):               # an unfinished character: wait
      return ""
    self.text = self._base + window
    if len(self.ids) - self._start > 2 * self.context:   # slide the window forward
      self._start = len(self.ids) - self.context
      self._base = self.text[:len(self.text) - len(self.tok.decode(self.ids[self._start:]))]
    return self._emit(final=False)

  def _emit(self, final: bool) -> str:
    end = len(self.text)
    for s in self.stops:
      i = self.text.find(s, max(0, self.sent - len(s) + 1))
      if i >= 0 and i < end:
        end, self.stopped = i, True
    if not self.stopped and not final:
      end = max(self.sent, end - self.hold)
    out = self.text[self.sent:end]
    self.sent = end
    return out

  def finish(self) -> str:
    """What is left at the end (an unfinished character as U+FFFD)."""
    if not self.stopped:
      self.text = self._base + self.tok.decode(self.ids[self._start:])
    return self._emit(final=True)
