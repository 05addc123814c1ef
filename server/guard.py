"""RequestGuard: the ASGI layer in front of every route that refuses what must not reach them.

- A request body over `max_body_bytes` gets 413 with an OpenAI error object. A declared
  Content-Length over the limit is refused before the app runs; a chunked body is cut off once it
  passes the limit. Either way the rest of the body is read and dropped (not kept) before the
  answer, since HTTP/1.1 clients read the response only after sending their whole request; the
  connection is then closed. (A client that sent `Expect: 100-continue`, as curl does for large
  bodies, gets the 413 without sending its body.)
- While the server drains for shutdown (ServerState.draining), every request but /health and
  /metrics gets 503 (and /health itself answers 503, so balancers stop sending).
"""
from __future__ import annotations

import json
import time

from linrnn_server.errors import APIError

# reading and dropping an oversized body stops after this long (the connection is then closed)
DISCARD_SECONDS = 10.0
ALWAYS_OPEN = ("/health", "/metrics")


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(f"The request body is too large{got}: this server accepts at most {limit} bytes "
                    f"(--max-request-bytes).", 413, "invalid_request_error", None, "request_too_large")


def shutting_down() -> APIError:
    return APIError("The server is shutting down and takes no new requests.", 503, "service_unavailable_error",
                    None, "shutting_down", {"Connection": "close", "Retry-After": "1"})


class RequestGuard:
    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and scope.get("path") not in ALWAYS_OPEN:
            await _discard(receive)
            return await _respond(send, shutting_down(), self.state)
        limit = self.state.max_body_bytes
        if not limit:
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        declared = int(declared) if declared and declared.isdigit() else None
        if declared is not None and declared > limit:
            if _header(scope, b"expect") != b"100-continue":  # else the client waits and sends nothing
                await _discard(receive)
            return await _respond(send, too_large(limit, declared), self.state)

        seen = 0
        over = False
        started = False

        async def limited_receive():
            nonlocal seen, over
            if over:  # the app asked again after the cut: the body "ended"
                return {"type": "http.request", "body": b"", "more_body": False}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    over = True
                    if msg.get("more_body"):
                        await _discard(receive)
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        async def guarded_send(msg):
            nonlocal started
            if over:  # whatever the app made of the truncated body, the answer is 413
                if msg["type"] == "http.response.start" and not started:
                    started = True
                    await _respond(send, too_large(limit), self.state)
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, guarded_send)


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.strip().lower()
    return None


async def _discard(receive) -> None:
    """Read what is left of the request body, dropping it, for at most DISCARD_SECONDS."""
    deadline = time.monotonic() + DISCARD_SECONDS
    while time.monotonic() < deadline:
        msg = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body"):
            return


async def _respond(send, err: APIError, state) -> None:
    state.metrics.refused[str(err.status)] += 1
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items() if k.lower() != "connection"]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
