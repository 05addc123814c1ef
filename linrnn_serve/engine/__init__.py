"""Engine core (step loop, its process and client), executor seam, tokenizer, abort. Knows no HTTP.

    LLMEngine        engine/llm_engine.py   add_request / step / abort / has_unfinished_requests
    Executor         engine/executor.py     the core's handle on its workers (runner/worker.py), one per device
    EngineCore       engine/core.py         per-step deltas; the core process's main (run_engine_core)
    AsyncMPClient    engine/core_client.py  the server's client of the core process: generate / abort / stats
    protocol         engine/protocol.py     msgspec messages between core and client
    AsyncLLMEngine   engine/async_engine.py in-process alternative: the step loop in a background thread
    Tokenizer        engine/tokenizer.py    encode / decode / chat template / incremental detokenizer (DecodeStream)
    validate_request engine/validation.py   the one place a request is checked (and its extras applied)
    errors           engine/errors.py       typed errors: RequestError (SamplingParamError, StructuredOutputError,
                                            PromptTooLongError), EngineFullError, EngineDeadError
    outputs          engine/outputs.py      RequestOutput, CompletionOutput
"""
from __future__ import annotations

_LAZY = {
    "LLMEngine": "linrnn_serve.engine.llm_engine",
    "AsyncLLMEngine": "linrnn_serve.engine.async_engine",
    "EngineDeadError": "linrnn_serve.engine.outputs",
    "AsyncMPClient": "linrnn_serve.engine.core_client",
    "Tokenizer": "linrnn_serve.engine.tokenizer",
}


def __getattr__(name):  # lazy: importing engine.outputs must not pull in torch and the model
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
