"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions, /v1/models,
plus /health (200 once the model is loaded and compiled, 503 before) and Prometheus
/metrics.  Every error is OpenAI's {"error": {message, type, param, code}} JSON.

A request becomes a `worker.Job` in the bounded FIFO queue (429 with Retry-After when
it is full).  Streaming answers are server-sent events ("data: {chunk}", ending with
"data: [DONE]").  A stream's status and headers are sent as soon as its job is queued,
so that they are written while the engine runs the prompt pass, not after the first
token (about 0.4 ms of time to first token, docs/serve.md); an error after that (a
timeout, a failed generation) is an event {"error": ...}.  A client that disconnects
cancels its job: the engine stops at its next token.
"""

from __future__ import annotations

import asyncio
import json
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.exceptions import StarletteHTTPException

from moejax.serve import chat as chat_lib
from moejax.serve import protocol
from moejax.serve.worker import Job, QueueFull


def error_response(e: protocol.APIError, headers=None) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(worker, limits: protocol.Limits, metrics, tok, template) -> FastAPI:
  """tok: the tokenizer; template: a chat.Template or None (chat not served)."""
  app = FastAPI(title="moejax", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(protocol.APIError)
  async def api_error(_, e: protocol.APIError):
    return error_response(e)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_, e: StarletteHTTPException):
    msg = ("no such route; this server answers POST /v1/completions, "
           "POST /v1/chat/completions, GET /v1/models, /health, /metrics"
           if e.status_code == 404 else str(e.detail))
    return error_response(protocol.APIError(e.status_code, msg, code=str(e.status_code)))

  def ready():
    if worker.failed is not None:
      raise protocol.APIError(503, f"the model failed to load: {worker.failed}",
                              "server_error", code="load_failed")
    if not worker.ready.is_set():
      raise protocol.APIError(503, "the model is still loading and compiling; GET /health "
                              "answers 200 once it is ready", "server_error",
                              code="model_loading")

  async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
      body = json.loads(raw)
    except ValueError as e:
      raise protocol.bad(f"We could not parse the JSON body of your request ({e}); send a "
                         "JSON object, e.g. {\"model\": ..., \"prompt\": ...}") from None
    if not isinstance(body, dict):
      raise protocol.bad("the request body must be a JSON object")
    model = body.get("model")
    if model != limits.model_id:
      raise protocol.bad(f"The model {model!r} does not exist: this server serves "
                         f"{limits.model_id!r} (GET /v1/models)", "model", "model_not_found")
    return body

  @app.get("/health")
  async def health():
    if worker.failed is not None:
      return JSONResponse({"status": "failed", "error": str(worker.failed)}, 503)
    if not worker.ready.is_set():
      return JSONResponse({"status": "loading"}, 503)
    return {"status": "ok", "model": limits.model_id, "queue_depth": worker.depth()}

  @app.get("/metrics")
  async def prometheus():
    return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": limits.model_id, "object": "model",
                                        "created": 0, "owned_by": "moejax"}]}

  async def completions(request: Request):
    ready()
    body = await json_body(request)
    ids = protocol.completion_prompt(body, tok)
    return await run(request, protocol.parse(body, limits, ids, "max_tokens"), chat=False)

  async def chat_completions(request: Request):
    ready()
    body = await json_body(request)
    if template is None:
      raise protocol.APIError(
          400, f"{limits.model_id!r} has no chat template (no chat_template in its "
          "tokenizer_config.json), so only /v1/completions is served", code="no_chat_template")
    text = template.render(chat_lib.messages(body))
    req = protocol.parse(body, limits, tok.encode(text), "max_completion_tokens")
    return await run(request, req, chat=True)

  # Plain Starlette routes: they take the raw Request and return a Response, so FastAPI's
  # request handling (dependencies, validation, serialization) has nothing to do there,
  # and skipping it brings the first token ~0.1 ms sooner (docs/serve.md).  Errors still
  # go through the handlers above.
  app.add_route("/v1/completions", completions, methods=["POST"])
  app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

  async def run(request: Request, req: protocol.Request, chat: bool):
    from moejax.model.sampler import SamplingParams
    worker.check_policy(req.policy)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    sink = lambda kind, value: loop.call_soon_threadsafe(events.put_nowait, (kind, value))
    sp = SamplingParams(req.temperature, req.top_p, req.max_tokens, limits.eos_ids)
    job = Job(req.prompt_ids, sp, req.seed, req.policy, req.stops, req.timeout_s, sink,
              first_sent=threading.Event() if req.stream else None)
    try:
      worker.submit(job)
    except QueueFull as e:
      return error_response(protocol.APIError(
          429, f"the request queue is full ({worker.depth()} waiting; the server runs one "
          f"request at a time): retry after {e.retry_after_s} s", "rate_limit_error",
          code="queue_full"), headers={"Retry-After": str(e.retry_after_s)})
    resp = protocol.Response(chat, limits.model_id)
    if req.stream:      # headers now, while the prompt pass runs; a client gone cancels
      return StreamingResponse(stream(events, job, resp, req),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    try:
      event = await next_event(request, events, job)
    except BaseException:
      job.cancel.set()
      raise
    if event is None:                       # the client left
      return PlainTextResponse("", status_code=499)
    parts = []
    try:
      while event[0] == "text":
        parts.append(event[1])
        event = await next_event(request, events, job)
        if event is None:
          return PlainTextResponse("", status_code=499)
    finally:
      job.cancel.set()
    if event[0] == "error":
      return error_response(event[1])
    result = event[1]
    use = protocol.usage(result.prompt_tokens, len(result.text_tokens), result.offload)
    return JSONResponse(resp.full("".join(parts), result.finish_reason, use))

  return app


async def next_event(request: Request, events: asyncio.Queue, job):
  """The job's next event; None (and the job cancelled) if the client disconnects."""
  while True:
    try:
      return await asyncio.wait_for(events.get(), timeout=0.5)
    except asyncio.TimeoutError:
      if await request.is_disconnected():
        job.cancel.set()
        return None


def sse(obj) -> str:
  return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream(events: asyncio.Queue, job, resp: protocol.Response, req):
  """The server-sent events of a streamed answer; leaving early cancels the job (a
  client gone while the job waits or runs: Starlette cancels this generator)."""
  try:
    event, head = await events.get(), True
    while True:
      kind, value = event
      if kind == "text":
        yield sse(resp.chunk(value, first=head))
        if head:                 # resumed once the chunk is written: the engine goes on
          job.first_sent.set()
        head = False
      elif kind == "error":
        yield sse(value.body())
        break
      else:
        use = protocol.usage(value.prompt_tokens, len(value.text_tokens), value.offload)
        yield sse(resp.chunk(None, value.finish_reason, None if req.include_usage else use,
                             first=head))
        if req.include_usage:
          yield sse(resp.usage_chunk(use))
        break
      event = await events.get()
    yield "data: [DONE]\n\n"
  finally:
    job.cancel.set()       # a client gone mid-stream: the engine stops at its next token
    job.first_sent.set()   # and does not wait for a first chunk that will not be written
