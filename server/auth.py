"""API-key check for the `/v1` routes and the tokenizer routes (`--api-key`).

The key is compared as SHA-256 digests with `hmac.compare_digest`: constant time, and the time does
not even depend on the length of the key sent. /health and /metrics stay open for probes and
Prometheus scrapers (as in vLLM).
"""
from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from linrnn_server.errors import unauthorized


def _digest(s: str) -> bytes:
    return hashlib.sha256(s.encode("utf-8", errors="surrogatepass")).digest()


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 with an OpenAI error object unless `Authorization: Bearer <key>`. Async
    (it never blocks): FastAPI runs a plain `def` dependency in its thread pool, and that hop cost every
    request two event-loop iterations and a GIL hand-over (several ms with many streams, issue #16)."""
    key = request.app.state.server.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    ok = hmac.compare_digest(_digest(token.strip()), _digest(key))
    if not (ok and scheme.lower() == "bearer"):
        raise unauthorized()
