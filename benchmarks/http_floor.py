"""The floor of an HTTP round trip on this machine, for launch.bench_serve's TTFT ratio.

  python -m launch.bench_http_floor --out=bench_http_floor.json

Two servers in a child process, each answering at once with a perf_counter stamp taken
when its code sees the request; the client is the one launch.bench_serve uses (the
standard library's http.client, one keep-alive connection), a request every --gap_s:

  raw       a uvloop asyncio.Protocol answering a fixed HTTP response (no HTTP stack)
  uvicorn   uvicorn (httptools and uvloop, as launch.serve runs) with a 4-line ASGI app

Per server the medians of: client write -> the server's code, and the round trip.
Stamps compare across the processes (perf_counter is CLOCK_MONOTONIC on Linux).
docs/serve.md reads the round trip against the demo's prompt pass.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time

from absl import flags


FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 200, "Requests per server.")
flags.DEFINE_float("gap_s", 0.02, "Pause before each request (the server's loop idles).")
flags.DEFINE_string("out", "bench_http_floor.json", "JSON output.")

BODY = json.dumps({"model": "demo", "prompt": "def fibonacci(n):", "stream": True}).encode()


def _serve(kind: str, sock: socket.socket):
  """In the child: serve on `sock` until killed."""
  import asyncio
  import uvloop
  if kind == "uvicorn":
    import uvicorn

    async def app(scope, receive, send):
      if scope["type"] == "http":
        t = repr(time.perf_counter()).encode()
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": t})
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return

  class Raw(asyncio.Protocol):
    def connection_made(self, transport):
      self.transport = transport

    def data_received(self, data):
      t = repr(time.perf_counter()).encode()
      self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(t) + t)
  loop = uvloop.new_event_loop()
  loop.run_until_complete(loop.create_server(Raw, sock=sock))
  loop.run_forever()


def measure(kind: str) -> dict:
  import http.client
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  sock.listen(16)
  port = sock.getsockname()[1]
  pid = os.fork()
  if pid == 0:                      # the child serves; killed below
    try:
      _serve(kind, sock)
    finally:
      os._exit(0)
  sock.close()
  try:
    time.sleep(2.0)                 # the child's imports and start-up
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    to_server, round_trip = [], []
    for _ in range(FLAGS.requests):
      time.sleep(FLAGS.gap_s)
      t0 = time.perf_counter()
      conn.request("POST", "/v1/completions", body=BODY,
                   headers={"Content-Type": "application/json"})
      stamp = float(conn.getresponse().read())
      t1 = time.perf_counter()
      to_server.append(1e3 * (stamp - t0))
      round_trip.append(1e3 * (t1 - t0))
  finally:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
  return dict(to_server_ms=statistics.median(to_server),
              round_trip_ms=statistics.median(round_trip))


def main(_):
  from moejax.extras import need
  need("uvicorn", "serve", "this bench")
  need("uvloop", "serve", "this bench")
  res = {k: measure(k) for k in ("raw", "uvicorn")}
  res.update(requests=FLAGS.requests, gap_s=FLAGS.gap_s, cpu_count=os.cpu_count(),
             load_avg=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M"))
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)
  for k in ("raw", "uvicorn"):
    print(f"{k:8s} client write -> server code {res[k]['to_server_ms']:.3f} ms, round trip "
          f"{res[k]['round_trip_ms']:.3f} ms (medians of {FLAGS.requests})")
  print(f"wrote {FLAGS.out}")
