"""The FastAPI app: routes, API-key dependency, OpenAI-shaped error handlers, engine lifecycle.

    app = build_app(engine, served_model_names=["my-model"], api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

`engine` is an AsyncMPClient (the engine core in its own process, what `linrnn-serve` uses), an
in-process AsyncLLMEngine, or anything with their interface (generate / abort / tokenizer /
stats / shutdown). A RequestGuard (guard.py) in front of the routes refuses oversized bodies (413)
and, while the server drains, new requests (503). Behind it DirectRoutes hands POST /v1/completions and
/v1/chat/completions straight to their endpoints (the hot path: no FastAPI routing per request). Graceful shutdown: `app.state.server.drain(t)`
(called by cli.py on SIGINT / SIGTERM) lets in-flight requests finish, aborts what is left with a
final chunk; the lifespan's end then stops the engine.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from linrnn_server.auth import require_api_key
from linrnn_server.engine_client import EngineClient
from linrnn_server.errors import APIError, http_error, internal
from linrnn_server.metrics import ServerMetrics
from linrnn_server.guard import RequestGuard
from linrnn_server.routes import chat, completions, health, metrics, models, responses, tokenize
from linrnn_server.serving import DEFAULT_MAX_REQUEST_BYTES, ClientDisconnected, ServerState, log_stats_forever

log = logging.getLogger(__name__)


def build_app(engine: Any, served_model_names: list[str] | None = None, api_key: str | None = None,
              shutdown_mode: str = "finish", shutdown_timeout: float = 10.0, owns_engine: bool = True,
              log_requests: bool = False, stats_interval: float | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, default_max_tokens: int | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`. With `owns_engine`, the app's shutdown stops the engine
    ('finish': in-flight requests may complete within `shutdown_timeout`, then the rest are aborted).
    `log_requests`: one INFO line per request; `stats_interval`: seconds between statistics lines.
    Request bodies over `max_request_bytes` (0: no limit) get 413; `default_max_tokens` caps requests
    that set no max_tokens (serving.apply_default_max_tokens)."""
    client = EngineClient(engine, served_model_names)
    state = ServerState(client, ServerMetrics(client.served_model_names[0]), api_key or None,
                        log_requests=log_requests, max_body_bytes=max_request_bytes,
                        default_max_tokens=default_max_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("serving %s (max_model_len %d)%s", ", ".join(client.served_model_names), client.max_model_len,
                 "; API key required on /v1 and /tokenize, /detokenize" if state.api_key else "")
        stats_task = asyncio.ensure_future(log_stats_forever(client, stats_interval)) if stats_interval else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        if owns_engine:
            log.info("shutting down: %d request(s) in flight", len(state.active))
            await client.shutdown(mode=shutdown_mode, timeout=shutdown_timeout)

    app = FastAPI(title="linrnn-serve", description="OpenAI-compatible API of linrnn-serve", lifespan=lifespan)
    app.state.server = state
    # inner first: RequestGuard's checks (413, draining) come before the generation routes' direct path
    app.add_middleware(DirectRoutes, routes={"/v1/completions": completions.create_completion,
                                             "/v1/chat/completions": chat.create_chat_completion},
                       handlers=app.exception_handlers)
    app.add_middleware(RequestGuard, state=state)
    secured = [Depends(require_api_key)] if state.api_key else []  # FastAPI solves even a no-op dependency
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(models.router, dependencies=secured)
    app.include_router(completions.router, dependencies=secured)
    app.include_router(chat.router, dependencies=secured)
    app.include_router(responses.router, dependencies=secured)
    app.include_router(tokenize.router, dependencies=secured)

    def render(err: APIError) -> JSONResponse:
        state.metrics.refused[str(err.status)] += 1
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return render(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):  # path / query parameters
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        return render(APIError(f"Invalid value for '{loc}': {first.get('msg')}", 400, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = f"Unknown route: {request.method} {request.url.path}" if exc.status_code == 404 else None
        if exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
        return render(http_error(exc.status_code, msg))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return render(internal(exc))

    return app


class DirectRoutes:
    """The generation routes' hot path: a POST to /v1/completions or /v1/chat/completions goes straight to its
    endpoint function, past FastAPI's router, dependency solver and exception middleware (~50-60 us a request on
    this project's CPU, a few ms of a c = 64 wave's hand-back, when the next 64 requests all arrive at once). The
    API key is checked as the routers' dependency checks it, and the endpoint's errors get the app's own handlers
    (`handlers`: FastAPI's table; an exception without one propagates to the server-error handler, as it does
    from the router). Everything else, other methods on these paths included, goes through FastAPI."""

    def __init__(self, app, routes: dict, handlers: dict):
        self.app, self.routes, self.handlers = app, routes, handlers

    async def __call__(self, scope, receive, send):
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.routes.get(scope["path"])
        if endpoint is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive, send)
        try:
            await require_api_key(request)
            response = await endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception):
        for cls in type(exc).__mro__:
            if cls is Exception:  # the catch-all: ServerErrorMiddleware's, outside this layer
                return None
            if cls in self.handlers:
                return self.handlers[cls]
        return None
