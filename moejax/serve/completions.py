"""POST /v1/completions and /v1/chat/completions as a plain ASGI handler in front of the
FastAPI application (which answers every other route, and these for other methods).

    app = Completions(worker, limits, tok, template, fallback=fastapi_app)

Why not a FastAPI route: the first token's path is the server's whole latency budget
(docs/serve.md), and a route adds the middleware stack and, for a stream, Starlette's
`StreamingResponse` (a task group and a disconnect listener per response).  Here a
request is the ASGI messages it needs: the body read, the job queued, the status and
headers sent, then one body message per server-sent event.  Errors are OpenAI's
{"error": ...} JSON as everywhere else.  A client that disconnects cancels its job at
once, streamed or not (a task awaits the ASGI `http.disconnect`), and the engine stops
at its next token.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from moejax.serve import chat as chat_lib
from moejax.serve import protocol
from moejax.serve.jobs import Job
from moejax.serve.worker import QueueFull

ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}   # path -> chat
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]


def sse(obj) -> bytes:
  return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def send_json(send, status: int, obj, headers=()):
  body = json.dumps(obj).encode()
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode()), *headers]})
  await send({"type": "http.response.body", "body": body})


async def read_body(receive) -> bytes | None:
  """The request's body; None when the client left before sending it all."""
  parts = []
  while True:
    msg = await receive()
    if msg["type"] == "http.disconnect":
      return None
    parts.append(msg.get("body", b""))
    if not msg.get("more_body"):
      return b"".join(parts)


def refused(status: int) -> str:
  """The outcome of a request answered `status` before it was queued."""
  return "unavailable" if status == 503 else "error" if status >= 500 else "invalid"


class Completions:
  """The ASGI application: the two completion routes here, the rest to `fallback`."""

  def __init__(self, worker, limits: protocol.Limits, tok, template, fallback, guard=None):
    """guard: an auth.Guard (the API key), or None: every route is open."""
    self.worker, self.limits, self.tok, self.template = worker, limits, tok, template
    self.fallback, self.guard = fallback, guard
    self.open: dict[int, tuple] = {}      # id(job) -> (job, its event queue): running

  def stop_all(self):
    """Ends every running request now (Ctrl-C; on the event loop): its job is cancelled
    at its next token and its client gets a 503 `shutting_down` (a stream: an error
    event, then [DONE]), so that each response completes before the server closes."""
    err = protocol.APIError(503, "the server is shutting down (interrupted)", "server_error",
                            code="shutting_down")
    for job, events in list(self.open.values()):
      job.cancel.set()
      events.put_nowait(("error", err))

  async def __call__(self, scope, receive, send):
    arrived = time.perf_counter()    # the request's clock (Job.created): /metrics' TTFT
    if scope["type"] == "http":
      send = self.counting(send)
      denied = self.guard.check(scope) if self.guard is not None else None
      if denied is not None:
        return await send_json(send, 401, denied.body(), [(b"www-authenticate", b"Bearer")])
    chat = ROUTES.get(scope.get("path")) if scope["type"] == "http" else None
    if chat is None or scope["method"] != "POST":
      return await self.fallback(scope, receive, send)
    raw = await read_body(receive)
    if raw is None:
      self.worker.metrics.outcome("cancelled")      # the client left before its body
      return
    try:
      req = self.request(raw, chat)
      self.worker.check_policy(req.policy)
    except protocol.APIError as e:
      self.worker.metrics.outcome(refused(e.status))
      return await send_json(send, e.status, e.body())
    except Exception as e:  # pylint: disable=broad-except
      self.worker.metrics.outcome("error")           # a fault here, not the client's
      err = protocol.APIError(500, f"the request failed: {type(e).__name__}: {e}",
                              "server_error")
      return await send_json(send, 500, err.body())
    await self.run(req, chat, receive, send, arrived)

  def counting(self, send):
    """`send` that counts each answer's status (moejax_http_responses_total)."""
    metrics = self.worker.metrics

    async def counted(message):
      if message["type"] == "http.response.start":
        metrics.responded(message["status"])
      await send(message)
    return counted

  def ready(self):
    worker = self.worker
    if worker.failed is not None:
      raise protocol.APIError(503, f"the model failed to load: {worker.failed}",
                              "server_error", code="load_failed")
    if not worker.ready.is_set():
      raise protocol.APIError(503, "the model is still loading and compiling; GET /health "
                              "answers 200 once it is ready", "server_error",
                              code="model_loading")

  def request(self, raw: bytes, chat: bool) -> protocol.Request:
    """The body -> a validated protocol.Request (APIError: a 4xx/503 to answer)."""
    self.ready()
    try:
      body = json.loads(raw)
    except ValueError as e:
      raise protocol.bad(f"We could not parse the JSON body of your request ({e}); send a "
                         "JSON object, e.g. {\"model\": ..., \"prompt\": ...}") from None
    if not isinstance(body, dict):
      raise protocol.bad("the request body must be a JSON object")
    model = body.get("model")
    if model != self.limits.model_id:
      raise protocol.bad(f"The model {model!r} does not exist: this server serves "
                         f"{self.limits.model_id!r} (GET /v1/models)", "model",
                         "model_not_found")
    if not chat:
      ids = protocol.completion_prompt(body, self.tok)
      req = protocol.parse(body, self.limits, ids, "max_tokens")
      if req.echo:
        p = body.get("prompt")
        p = p[0] if isinstance(p, list) and len(p) == 1 else p
        req.prompt_text = p if isinstance(p, str) else self.tok.decode(ids)
      return req
    if self.template is None:
      raise protocol.APIError(
          400, f"{self.limits.model_id!r} has no chat template (no chat_template in its "
          "tokenizer_config.json), so only /v1/completions is served", code="no_chat_template")
    text = self.template.render(chat_lib.messages(body))
    return protocol.parse(body, self.limits, self.tok.encode(text), "max_completion_tokens")

  async def run(self, req: protocol.Request, chat: bool, receive, send, arrived: float):
    from moejax.model.sampler import SamplingParams
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(kind, value):
      try:
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))
      except RuntimeError:       # the loop has closed: the server stopped, nobody listens
        pass
    sp = SamplingParams(req.temperature, req.top_p, req.max_tokens, self.limits.eos_ids)
    job = Job(req.prompt_ids, sp, req.seed, req.policy, req.stops, req.timeout_s, sink,
              first_sent=threading.Event() if req.stream else None, logprobs=req.logprobs,
              score_prompt=req.echo and req.logprobs is not None, presence=req.presence,
              frequency=req.frequency, created=arrived)
    try:
      self.worker.submit(job)
    except QueueFull as e:
      err = protocol.APIError(
          429, f"the request queue is full ({self.worker.depth()} waiting for the engine): "
          f"retry after {e.retry_after_s} s", "rate_limit_error",
          code="queue_full")
      return await send_json(send, 429, err.body(),
                             [(b"retry-after", str(e.retry_after_s).encode())])

    def gone(task):                  # the client left (or the response is complete)
      if not task.cancelled():
        job.cancel.set()
        events.put_nowait(("gone", None))
    watch = asyncio.ensure_future(receive())
    watch.add_done_callback(gone)
    resp = protocol.Response(chat, self.limits.model_id)
    self.open[id(job)] = (job, events)
    try:
      if req.stream:
        await self.stream(events, job, resp, req, send)
      else:
        await self.whole(events, job, resp, req, send)
    finally:
      self.open.pop(id(job), None)
      job.cancel.set()       # the engine stops at its next token (a no-op once it is done)
      if job.first_sent is not None:
        job.first_sent.set()   # and does not wait for a first chunk that was not written
      watch.remove_done_callback(gone)
      watch.cancel()

  async def stream(self, events, job, resp, req, send):
    """Status and headers now (the prompt pass runs meanwhile), then one body message
    per event; an error after the headers is an event {"error": ...}."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    head = True
    while True:
      kind, value = await events.get()
      if kind == "gone":
        return
      if kind == "text":
        await send({"type": "http.response.body", "body": sse(resp.chunk(value, first=head)),
                    "more_body": True})
        if head:                 # written: the engine decodes the second token
          job.first_sent.set()
        head = False
        continue
      if kind == "error":
        out = sse(value.body())
      else:
        use = protocol.usage(value.prompt_tokens, len(value.text_tokens), value.offload,
                             req.ignored)
        out = sse(resp.chunk(None, value.finish_reason, None if req.include_usage else use,
                             first=head))
        if req.include_usage:
          out += sse(resp.usage_chunk(use))
      await send({"type": "http.response.body", "body": out + b"data: [DONE]\n\n"})
      return

  async def whole(self, events, job, resp, req, send):
    parts = []
    while True:
      kind, value = await events.get()
      if kind == "gone":
        return
      if kind == "text":
        parts.append(value)
        continue
      if kind == "error":
        return await send_json(send, value.status, value.body())
      use = protocol.usage(value.prompt_tokens, len(value.text_tokens), value.offload,
                           req.ignored)
      text = (req.prompt_text if req.echo else "") + "".join(parts)
      return await send_json(send, 200, resp.full(text, value.finish_reason, use,
                                                  self.logprobs(req, resp.chat, value)))

  def logprobs(self, req: protocol.Request, chat: bool, result) -> dict | None:
    """The choice's `logprobs` in the route's format (None when not asked for)."""
    from moejax.serve import logprobs as logprobs_lib
    if req.logprobs is None:
      return None
    if chat:
      return logprobs_lib.chat_logprobs(self.tok, result.text_tokens, result.logprobs)
    ids, entries = list(result.text_tokens), list(result.logprobs)
    if req.echo:
      ids, entries = req.prompt_ids + ids, result.prompt_logprobs + entries
    return logprobs_lib.completion_logprobs(self.tok, ids, entries)
