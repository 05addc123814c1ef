"""GET /v1/models and GET /v1/models/{model}."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from linrnn_server.errors import model_not_found
from linrnn_server.protocol import ModelCard, ModelList
from linrnn_server.serving import ServerState, state_of

router = APIRouter()


def _card(state: ServerState, name: str) -> ModelCard:
    eng = state.engine
    return ModelCard(id=name, created=int(state.started), root=eng.model_root, max_model_len=eng.max_model_len)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = state_of(request)
    return ModelList(data=[_card(state, n) for n in state.model_names])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> ModelCard:
    state = state_of(request)
    if model not in state.model_names:
        raise model_not_found(model, state.model_names)
    return _card(state, model)
