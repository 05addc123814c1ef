"""GET /metrics: Prometheus text format (see linrnn_server.metrics for the series)."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from linrnn_server.metrics import CONTENT_TYPE
from linrnn_server.serving import state_of

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    return Response(state.metrics.render(state.engine.stats()), media_type=CONTENT_TYPE)
