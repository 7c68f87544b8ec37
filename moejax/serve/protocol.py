"""OpenAI request fields -> what a `Job` needs, OpenAI error JSON, and response bodies.

Served fields: prompt (one string or one list of token ids) or messages, max_tokens
(max_completion_tokens for chat), temperature, top_p, seed, stop, stream,
stream_options.include_usage, presence_penalty and frequency_penalty (-2..2), logprobs
(completions: 0-5 alternatives; chat: true, with top_logprobs 0-5) and echo (completions;
with echo, max_tokens may be 0) without stream.  Fields that would change the answer and
that this server cannot honour (n > 1, suffix, logit_bias, best_of > 1, tools,
response_format) are refused with a 400 naming them, never silently ignored.

The extension object `moejax` (send it with the openai client as
`extra_body={"moejax": {...}}`):
  policy          a preset (quality, speed, baseline) or a miss rule for this request
  tau             the threshold rule's gate share, (0, 1]
  admission_beta  background admission threshold (> 0), or 0 / false: admission off
  eviction        lru, lfu, least_stale
  timeout_s       this request's timeout (at most the server's --request_timeout_s)
With --norequest_policies the first four are ignored (the launch policy runs) and
`usage.moejax.ignored` lists the ones a request sent.
The expert cache is shared by every request and persists across them; its budget
(--cache_fraction) is a launch setting.  Each response's `usage.moejax` holds the
request's offload statistics (`offload_usage`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any


class APIError(Exception):
  """An error answered as OpenAI's {"error": {message, type, param, code}}."""

  def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                   param, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
  return APIError(400, message, param=param, code=code)


@dataclasses.dataclass
class Limits:
  model_id: str
  max_len: int                 # the KV cache: prompt + max_tokens
  timeout_s: float             # --request_timeout_s
  policy: Any                  # the launch PolicyParams
  eos_ids: tuple[int, ...]
  request_policies: bool = True   # False: the policy fields of `moejax` are ignored


@dataclasses.dataclass
class Request:
  prompt_ids: list[int]
  max_tokens: int
  temperature: float
  top_p: float
  seed: int
  stops: list[str]
  stream: bool
  include_usage: bool
  policy: Any
  timeout_s: float
  logprobs: int | None = None       # top alternatives per token (0-5); None: no log-probs
  echo: bool = False                # completions: the prompt before the completion
  presence: float = 0.0             # presence_penalty
  frequency: float = 0.0            # frequency_penalty
  prompt_text: str = ""             # echo: the text echoed before the completion
  ignored: list[str] = dataclasses.field(default_factory=list)   # fields not honoured


def _number(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
  v = body.get(name)
  if v is None:
    return default
  kind = "an integer" if integer else "a number"
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not
                                                                 isinstance(v, int)):
    raise bad(f"'{name}' must be {kind}, got {v!r}", name)
  if lo is not None and (v <= lo if lo_open else v < lo):
    raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
  if hi is not None and v > hi:
    raise bad(f"'{name}' must be <= {hi}, got {v}", name)
  return v


UNSUPPORTED = (("n", 1), ("best_of", 1), ("suffix", None), ("logit_bias", None),
               ("tools", None), ("response_format", None))
MAX_TOP_LOGPROBS = 5       # logprobs (completions), top_logprobs (chat): at most


def log_probs(body, chat: bool):
  """-> (top: None (no log-probs) or 0-5 alternatives per token, echo)."""
  if chat:
    if body.get("echo") not in (None, False):
      raise bad("'echo' is a /v1/completions field; chat does not echo", "echo",
                "unsupported_parameter")
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
      raise bad(f"'logprobs' must be true or false, got {on!r}", "logprobs")
    top = _number(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not on:
      raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None, False
  if body.get("top_logprobs") is not None:
    raise bad("'top_logprobs' is a chat field; /v1/completions takes 'logprobs': N "
              f"(0-{MAX_TOP_LOGPROBS} alternatives)", "top_logprobs")
  top = None if body.get("logprobs") is False else _number(
      body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
  echo = body.get("echo") or False
  if not isinstance(echo, bool):
    raise bad(f"'echo' must be true or false, got {echo!r}", "echo")
  return top, echo


def parse(body: Any, limits: Limits, prompt_ids: list[int], max_tokens_field: str,
          ) -> Request:
  """The common fields of a completion or chat request (the prompt already encoded)."""
  for name, ok in UNSUPPORTED:
    v = body.get(name)
    if v is not None and v != ok and v != {}:
      raise bad(f"'{name}'={v!r} is not supported by this server (one sequence, batch 1, "
                f"one choice); leave it out", name, "unsupported_parameter")
  chat = max_tokens_field != "max_tokens"
  top, echo = log_probs(body, chat)
  # echo with max_tokens 0 scores the prompt alone (lm-evaluation-harness's log-likelihood)
  max_tokens = _number(body, max_tokens_field, None, lo=0 if echo else 1, integer=True)
  if max_tokens is None and max_tokens_field == "max_completion_tokens":
    max_tokens = _number(body, "max_tokens", None, lo=1, integer=True)
  room = limits.max_len - len(prompt_ids)
  if max_tokens is None:
    max_tokens = min(16 if max_tokens_field == "max_tokens" else room, room)
  if not prompt_ids:
    raise bad("the prompt encodes to no tokens", "prompt")
  if len(prompt_ids) + max(max_tokens, 1) > limits.max_len:   # the prompt pass needs room
    raise bad(f"This model's maximum context length is {limits.max_len} tokens (the "
              f"server's --max_len). However, you requested {len(prompt_ids) + max_tokens} "
              f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the completion). "
              f"Please reduce the prompt or the completion length.",
              "messages" if max_tokens_field != "max_tokens" else "prompt",
              "context_length_exceeded")
  temperature = _number(body, "temperature", 1.0, lo=0, hi=2)
  top_p = _number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
  seed = _number(body, "seed", 0, integer=True)
  stop = body.get("stop")
  stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
  if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str)
                                                              for s in stops):
    raise bad("'stop' must be a string or a list of up to 4 strings", "stop")
  stream = body.get("stream") or False
  if not isinstance(stream, bool):
    raise bad(f"'stream' must be true or false, got {stream!r}", "stream")
  opts = body.get("stream_options") or {}
  if not isinstance(opts, dict):
    raise bad("'stream_options' must be an object", "stream_options")
  if stream and (top is not None or echo):
    raise bad("'logprobs' and 'echo' are answered in a whole response: send them without "
              "'stream'", "logprobs" if top is not None else "echo", "unsupported_parameter")
  presence = _number(body, "presence_penalty", 0.0, lo=-2, hi=2)
  frequency = _number(body, "frequency_penalty", 0.0, lo=-2, hi=2)
  policy, timeout_s, ignored = extension(body.get("moejax"), limits)
  return Request(list(prompt_ids), max_tokens, float(temperature), float(top_p),
                 int(seed) % (2 ** 32), stops, stream, bool(opts.get("include_usage")),
                 policy, timeout_s, logprobs=top, echo=echo, presence=float(presence),
                 frequency=float(frequency), ignored=ignored)


POLICY_FIELDS = ("policy", "tau", "admission_beta", "eviction")


def extension(ext: Any, limits: Limits):
  """The `moejax` object -> (PolicyParams, timeout_s, the fields ignored: with
  limits.request_policies False, the policy fields are not read, the launch policy runs)."""
  from moejax.cache import policy as policy_lib
  if ext is None:
    return limits.policy, limits.timeout_s, []
  if not isinstance(ext, dict):
    raise bad("'moejax' must be an object, e.g. {\"policy\": \"speed\"}", "moejax")
  known = POLICY_FIELDS + ("timeout_s",)
  for k in ext:
    if k in ("cache_fraction", "cache_bytes"):
      raise bad(f"'moejax.{k}': the expert budget is a launch setting of the shared cache "
                f"(--{k}); it cannot change per request", f"moejax.{k}")
    if k not in known:
      raise bad(f"'moejax.{k}' is not a known field; the fields are {', '.join(known)}",
                f"moejax.{k}")
  timeout_s = _number(ext, "timeout_s", limits.timeout_s, lo=0, hi=limits.timeout_s,
                      lo_open=True)
  given = [k for k in POLICY_FIELDS if k in ext]
  if not given:
    return limits.policy, float(timeout_s), []
  if not limits.request_policies:     # --norequest_policies: one fixed policy
    return limits.policy, float(timeout_s), ["moejax." + k for k in given]
  name = ext.get("policy", limits.policy.name or limits.policy.miss)
  if not isinstance(name, str):
    raise bad(f"'moejax.policy' must be a string, got {name!r}", "moejax.policy")
  beta = ext.get("admission_beta")
  off = beta is False or beta == 0
  if beta is not None and not off and (isinstance(beta, bool) or
                                       not isinstance(beta, (int, float))):
    raise bad(f"'moejax.admission_beta' must be a number > 0 or 0/false (off), got {beta!r}",
              "moejax.admission_beta")
  tau = ext.get("tau")
  eviction = ext.get("eviction")
  try:
    pol = policy_lib.make_policy(name, tau=tau, eviction=eviction,
                                 admission_beta=None if off else beta)
    if off:
      pol = dataclasses.replace(pol, decision=dataclasses.replace(pol.decision,
                                                                  admission_beta=None))
  except (policy_lib.PolicyError, TypeError) as e:
    msg = str(e).replace("--policy", "moejax.policy").replace("--", "moejax.")
    raise bad(msg, "moejax." + ("policy" if "policy" in msg else "tau"), "invalid_policy")
  if tau is not None and pol.miss != "threshold":
    raise bad(f"'moejax.tau' applies to the threshold rule (policy threshold or quality); "
              f"{pol.describe()} ignores it", "moejax.tau", "invalid_policy")
  return pol, float(timeout_s), []


def completion_prompt(body: Any, tok) -> list[int]:
  p = body.get("prompt")
  if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
    p = p[0]
  if isinstance(p, str):
    return tok.encode(p)
  if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in p):
    if any(t < 0 or t >= tok.vocab_size for t in p):
      raise bad(f"a prompt token id is outside the vocabulary [0, {tok.vocab_size})", "prompt")
    return list(p)
  if isinstance(p, list) and len(p) > 1:
    raise bad("one prompt per request (this server runs batch 1); send the others as "
              "separate requests", "prompt")
  raise bad("'prompt' must be a string or a list of token ids", "prompt")


def offload_usage(stats: dict, eng, policy, ttft_s, tps, queue_s, compile_s=0.0,
                  prompt_fetches=None) -> dict:
  """`usage.moejax`: the request's offload statistics (per decode step); compile_s: the
  policy's first use compiled its programs, before the timed part (not in ttft, tpot).
  prompt_fetches: the experts its prompt copied (default: the engine's last prompt's)."""
  n = stats.get("tokens", 0)
  if prompt_fetches is None and eng.prefill_record:
    prompt_fetches = float(eng.prefill_record["fetches"])
  f = lambda k: round(float(stats[k]), 6) if n else None
  return {
      "policy": policy.describe(), "link": eng.link.describe(),
      "decode_steps": n, "hit_rate": f("hit_rate"),
      "substituted_call_pct": f("substituted_call_pct"),
      "substituted_mass_per_token": f("substituted_mass_per_token"),
      "substituted_mass_per_token_layer": f("substituted_mass_per_token_layer"),
      "fetches_per_token": f("fetches_per_token"), "tpot_ms": f("tpot_ms"),
      "wait_ms_per_token": f("wait_ms_per_token"),
      "ttft_ms": None if ttft_s is None else round(1e3 * ttft_s, 3),
      "decode_tokens_per_s": None if tps is None else round(tps, 3),
      "queue_ms": round(1e3 * queue_s, 3),
      "compile_ms": round(1e3 * compile_s, 3),
      "prompt_fetches": prompt_fetches,
  }


def usage(prompt_tokens: int, completion_tokens: int, offload: dict, ignored=()) -> dict:
  """ignored: request fields not honoured (`Request.ignored`), listed in usage.moejax."""
  if ignored:
    offload = dict(offload, ignored=list(ignored))
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens, "moejax": offload}


class Response:
  """Bodies of one response: the whole object, or its stream's chunks."""

  def __init__(self, chat: bool, model: str):
    self.chat, self.model = chat, model
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    self.created = int(time.time())
    self.object = "chat.completion" if chat else "text_completion"

  def _head(self, obj: str) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def full(self, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    if self.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}
    else:
      choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return dict(self._head(self.object), choices=[choice], usage=use)

  def chunk(self, text: str | None, finish: str | None = None, use: dict | None = None,
            first: bool = False) -> dict:
    if self.chat:
      delta = {"role": "assistant"} if first else {}
      if text:
        delta["content"] = text
      choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
      out = dict(self._head("chat.completion.chunk"), choices=[choice])
    else:
      out = dict(self._head("text_completion"),
                 choices=[{"index": 0, "text": text or "", "logprobs": None,
                           "finish_reason": finish}])
    if use is not None:
      out["usage"] = use
    return out

  def usage_chunk(self, use: dict) -> dict:
    obj = "chat.completion.chunk" if self.chat else "text_completion"
    return dict(self._head(obj), choices=[], usage=use)
