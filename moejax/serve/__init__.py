"""An OpenAI-compatible HTTP server over one `OffloadEngine` (`moejax-serve`,
`python -m launch.serve`), with the offload policy chosen per request.

  main      the program: flags, loading, start-up compiles, uvicorn
  worker    the engine's thread: a bounded FIFO queue, one request at a time (batch 1),
            per-request policy, cancellation, timeouts
  batching  --policy=none: every expert resident, up to --max_batch requests decoded
            together (continuous batching)
  protocol  OpenAI request fields -> a `Job`, errors as OpenAI error JSON, responses
  app       the FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models,
            /health, /metrics
  text      streamed text: incremental detokenizing and stop sequences
  chat      the checkpoint's chat template (tokenizer_config.json)
  metrics   the Prometheus counters

The cli tier: it may import every package below it; nothing imports it.
"""
