"""GET /health and GET|POST /ping (200 with an empty body while the engine runs, 503 otherwise or while
the server drains for shutdown, as vLLM; /ping is the SageMaker-style alias vLLM serves) and /version."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from linrnn_server.errors import APIError
from linrnn_server.guard import shutting_down
from linrnn_server.serving import state_of

router = APIRouter()


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(request: Request) -> Response:
    state = state_of(request)
    if state.draining:
        raise shutting_down()
    ok, why = state.engine.healthy()
    if not ok:
        raise APIError(f"The engine is not running: {why}", 503, "service_unavailable_error", None,
                       "engine_dead")
    return Response(status_code=200)


@router.get("/version")
async def server_version() -> dict:
    try:
        return {"version": version("linrnn-serve")}
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
        return {"version": "unknown"}
