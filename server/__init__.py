"""linrnn-serve's OpenAI-compatible HTTP server (import name `linrnn_server`).

    app.py           build_app(engine, ...) -> FastAPI: routes, auth, error handlers, lifecycle
    cli.py           `linrnn-serve serve`: add_arguments(parser), run(args)
    protocol.py      pydantic request / response models (OpenAI field names, vLLM extras)
    serving.py       what the generation routes share: parsing, checks, Generation (submit, merge, abort),
                     ServerState.drain (graceful shutdown)
    guard.py         ASGI guard in front of the routes: request-body limit (413), 503 while draining
    engine_client.py the thin adapter over the engine client (AsyncMPClient: the core in its own process)
    rendering.py     chat template rendering and SSE frames
    errors.py        OpenAI error objects; engine / validation exceptions -> HTTP status
    auth.py          --api-key check (constant time)
    metrics.py       Prometheus text rendering of the engine's stats
    routes/          one module per endpoint

Imports only the engine's public API (linrnn_serve.engine, .config, .sampling_params, .presets).
"""


def build_app(*args, **kwargs):
    from linrnn_server.app import build_app as _build

    return _build(*args, **kwargs)
