"""Step loop, async bridge (per-request queues), tokenizer ownership, abort. Knows no HTTP.

    LLMEngine        engine/llm_engine.py   add_request / step / abort / has_unfinished_requests
    AsyncLLMEngine   engine/async_engine.py generate(...) -> async iterator, abort, stats, shutdown
    Tokenizer        engine/tokenizer.py    encode / decode / chat template / incremental detokenizer
    outputs          engine/outputs.py      RequestOutput, CompletionOutput, EngineFullError, PromptTooLongError
"""
from __future__ import annotations

_LAZY = {
    "LLMEngine": "linrnn_serve.engine.llm_engine",
    "AsyncLLMEngine": "linrnn_serve.engine.async_engine",
    "EngineDeadError": "linrnn_serve.engine.async_engine",
    "Tokenizer": "linrnn_serve.engine.tokenizer",
}


def __getattr__(name):  # lazy: importing engine.outputs must not pull in torch and the model
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
