"""The ASGI application: OpenAI's /v1/completions and /v1/chat/completions
(`completions.Completions`, a plain ASGI handler in front), and a FastAPI application
for /v1/models, /health (200 once the model is loaded and compiled, 503 before) and
Prometheus /metrics.  With an API key (`auth.Guard`) every route but /health needs it
(401 otherwise).  Every error is OpenAI's {"error": {message, type, param, code}}
JSON.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse

from moejax.serve import protocol
from moejax.serve.completions import Completions


def error_response(e: protocol.APIError, headers=None) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(worker, limits: protocol.Limits, metrics, tok, template,
               guard=None) -> Completions:
  """tok: the tokenizer; template: a chat.Template or None (chat not served); guard: an
  auth.Guard (every route but /health needs its key), or None."""
  app = FastAPI(title="moejax", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_, e: StarletteHTTPException):
    msg = ("no such route; this server answers POST /v1/completions, "
           "POST /v1/chat/completions, GET /v1/models, /health, /metrics"
           if e.status_code == 404 else str(e.detail))
    return error_response(protocol.APIError(e.status_code, msg, code=str(e.status_code)))

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

  return Completions(worker, limits, tok, template, fallback=app, guard=guard)
