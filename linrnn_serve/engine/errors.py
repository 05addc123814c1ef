"""The engine's typed errors: what a request can be refused with, and why the engine stops serving.

    RequestError(ValueError)      the request itself is bad (HTTP 400); `param` names the field, `code` is
      SamplingParamError          OpenAI's error code (invalid_value, context_length_exceeded, ...)
      StructuredOutputError       a constraint that cannot be compiled
      PromptTooLongError          prompt + max_tokens cannot fit the context or the KV cache
    EngineFullError(RuntimeError) the waiting queue is full: retry later (HTTP 503)
    EngineDeadError(RuntimeError) the engine loop or core process stopped (HTTP 503)

The engine raises them (engine/validation.py is the one place that checks a request); the API server
maps them to OpenAI error objects (server/errors.py::from_engine_error) by type, `param` and `code`.
They cross the core process's channel by class name (`rebuild`). Plain classes: bottom of the imports.
"""
from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses because of what it asks for."""

    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class SamplingParamError(RequestError):
    """A sampling parameter out of range (SamplingParams.validate)."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param)


class StructuredOutputError(RequestError):
    """A constraint that cannot be compiled; the message names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param)


class PromptTooLongError(RequestError):
    """Prompt plus max_tokens cannot fit the model's context (or the KV cache)."""

    code = "context_length_exceeded"


class EngineFullError(RuntimeError):
    """The waiting queue is at max_queue_len: the request is refused (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop or core process stopped (shutdown, an internal error, killed): no more requests
    are served (HTTP 503)."""


_TYPES = {c.__name__: c for c in (RequestError, SamplingParamError, StructuredOutputError, PromptTooLongError,
                                  EngineFullError, EngineDeadError)}


def rebuild(kind: str, message: str, param: str | None = None, code: str | None = None) -> BaseException:
    """An error that crossed the core's channel as its class name, as the same type again (a ValueError
    the engine raised as a plain one stays a ValueError; anything else becomes a RuntimeError)."""
    cls = _TYPES.get(kind)
    if cls in (SamplingParamError, StructuredOutputError):
        return cls(param, message)
    if cls is not None and issubclass(cls, RequestError):
        return cls(message, param, code)
    if cls is not None:
        return cls(message)
    if kind == "ValueError":
        return RequestError(message, param, code)
    return RuntimeError(f"{kind}: {message}")
