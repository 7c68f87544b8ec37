"""Access control, as llama-server's and vLLM's `--api-key`: with a key, every route but
/health needs `Authorization: Bearer <key>`; anything else is a 401 in OpenAI's error JSON.

    guard = Guard(key)                  # key None or "": no check
    err = guard.check(scope)            # an APIError (401) or None, for an ASGI http scope

The key comes from --api_key or, when the flag is not given, MOEJAX_API_KEY.  Keys are
compared with `hmac.compare_digest` (time independent of where they differ).
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from moejax.serve import protocol

ENV = "MOEJAX_API_KEY"
OPEN_PATHS = ("/health",)        # a load balancer's probe carries no key


def resolve_key(flag_value: str | None) -> str | None:
  """--api_key if given, else $MOEJAX_API_KEY; None (no check) when neither is set."""
  key = flag_value if flag_value is not None else os.environ.get(ENV)
  return key or None


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False               # a name: it may resolve beyond this machine


def exposure_warning(host: str, key: str | None) -> str | None:
  """The start-up warning for a server that anyone on the network may use, else None."""
  if key or is_loopback(host):
    return None
  return (f"[moejax] WARNING: listening on {host}, beyond this machine, without an API key: "
          f"anyone who can reach the port can use the model. Set --api_key or {ENV}.")


class Guard:

  def __init__(self, key: str | None):
    self._key = key.encode() if key else None

  @property
  def on(self) -> bool:
    return self._key is not None

  def check(self, scope) -> protocol.APIError | None:
    if self._key is None or scope.get("path") in OPEN_PATHS:
      return None
    given = b""
    for name, value in scope.get("headers") or ():
      if name.lower() == b"authorization":
        given = value
        break
    scheme, _, token = given.partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
      return None
    msg = ("Incorrect API key provided" if given else
           "You didn't provide an API key: send it as 'Authorization: Bearer <key>' "
           "(the openai client's api_key)")
    return protocol.APIError(401, msg + "; this server's key is its --api_key "
                             f"(or {ENV})", code="invalid_api_key")
