"""The checkpoint's chat template: `chat_template` in its tokenizer_config.json (a Jinja
template, as transformers renders it), or none, and then /v1/chat/completions answers
that this model is served for completions only.

    tmpl = load_template(model_dir)          # None without one
    text = tmpl.render(messages)             # with add_generation_prompt=True
"""

from __future__ import annotations

import json
import os

from moejax.serve import protocol


class TemplateError(ValueError):
  pass


class Template:

  def __init__(self, source: str, special: dict):
    try:
      import jinja2
      from jinja2 import sandbox
    except ImportError as e:
      raise TemplateError("the chat template needs jinja2: pip install 'moejax[serve]'") from e

    def raise_exception(message):
      raise protocol.bad(f"the chat template refused the messages: {message}", "messages")

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                undefined=jinja2.Undefined)
    env.globals["raise_exception"] = raise_exception
    env.filters.setdefault("tojson", lambda v, **kw: json.dumps(v, **kw))
    try:
      self._tmpl = env.from_string(source)
    except jinja2.TemplateError as e:
      raise TemplateError(f"the chat template does not parse: {e}") from None
    self.special = special

  def render(self, messages) -> str:
    return self._tmpl.render(messages=messages, add_generation_prompt=True, **self.special)


def _token(v):
  return v.get("content") if isinstance(v, dict) else v


def load_template(model_dir: str | None) -> Template | None:
  """The folder's chat template, or None (no tokenizer_config.json, or no template in it)."""
  path = os.path.join(model_dir, "tokenizer_config.json") if model_dir else None
  if path is None or not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      conf = json.load(f)
  except (OSError, ValueError) as e:
    raise TemplateError(f"{path}: cannot read it ({e})") from None
  source = conf.get("chat_template")
  if isinstance(source, list):      # named templates: the default one
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default")
  if not isinstance(source, str) or not source.strip():
    return None
  special = {k: _token(conf.get(k)) or "" for k in ("bos_token", "eos_token")}
  try:
    return Template(source, special)
  except TemplateError as e:
    raise TemplateError(f"{path}: {e}") from None


def messages(body) -> list[dict]:
  """The request's messages, checked; content parts of type text are joined."""
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise protocol.bad("'messages' must be a non-empty list of {role, content}", "messages")
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise protocol.bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):
      parts = []
      for p in content:
        if not isinstance(p, dict) or p.get("type") != "text":
          raise protocol.bad(f"messages[{i}].content: only text parts are served",
                             f"messages[{i}].content")
        parts.append(str(p.get("text", "")))
      content = "".join(parts)
    if content is not None and not isinstance(content, str):
      raise protocol.bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
    out.append(dict(m, content=content or ""))
  return out
