"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every failure a client can cause is an `APIError` raised in a route (or mapped here from a pydantic
`ValidationError` or an engine exception) and rendered by the app's exception handlers, so no bad
request ever reaches the client as a bare 500 or a hung connection.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from linrnn_serve.engine.errors import EngineDeadError, EngineFullError, RequestError


class APIError(Exception):
    """A request that fails with an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def unsupported(param: str, what: str | None = None) -> APIError:
    return bad_request(what or f"'{param}' is not supported by this server", param, "unsupported_parameter")


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(f"The model '{name}' does not exist. This server serves: {', '.join(served)}.", 404,
                    "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError("Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.", 401,
                    "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def server_full(detail: str = "") -> APIError:
    msg = "The server is at capacity: its request queue is full. Retry later."
    return APIError(f"{msg} (engine: {detail})" if detail else msg, 503, "service_unavailable_error", None,
                    "server_overloaded", {"Retry-After": "1"})


def internal(exc: BaseException) -> APIError:
    return APIError(f"Internal server error: {type(exc).__name__}: {exc}", 500, "internal_server_error")


def http_error(status: int, message: str | None = None) -> APIError:
    """Starlette's own errors (404 unknown route, 405 wrong method) in the OpenAI shape."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return APIError(message or phrase, status, kind)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "json-or-python", "lax-or-strict"}


def _loc_name(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; pydantic union tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part.startswith("function-")):
            continue  # a union member tag, not a field
        else:
            out += ("." if out else "") + part
    return out


def from_validation_error(e: ValidationError, type_hints: dict[str, str] | None = None) -> APIError:
    """The first pydantic error, phrased like OpenAI's, naming the parameter. `type_hints` maps a
    union-typed field to what it accepts (pydantic reports one error per union member)."""
    errs = e.errors(include_url=False)
    # extra fields first: "Unrecognized request argument supplied: foo" is OpenAI's exact message
    extra = [x for x in errs if x["type"] == "extra_forbidden"]
    if extra:
        names = sorted({_loc_name(x["loc"]) for x in extra})
        return bad_request(f"Unrecognized request argument supplied: {', '.join(names)}", names[0],
                           "unknown_parameter")
    err = errs[0]
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                           None, "invalid_json")
    if err["type"] == "model_type" and not err["loc"]:
        return bad_request("The request body must be a JSON object.", None, "invalid_json")
    param = _loc_name(err["loc"]) or None
    top = err["loc"][0] if err["loc"] else None
    if type_hints and top in type_hints and err["type"] != "missing":
        return bad_request(f"Invalid type for '{top}': expected {type_hints[top]}.", top, "invalid_type")
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    # unions report one error per member; the message of the first is the clearest
    got = err.get("input")
    got_s = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    return bad_request(f"Invalid value for '{param}': {err['msg']} (got {got_s}).", param, "invalid_value")


def from_engine_error(e: BaseException, param_names: dict[str, str] | None = None) -> APIError | None:
    """The engine's typed errors (engine/errors.py) as OpenAI errors; None for anything else (a real
    server error). `param_names` renames the engine's parameter names to the route's request fields
    (chat: "prompt" -> "messages")."""
    if isinstance(e, EngineFullError):
        return server_full(str(e))
    if isinstance(e, EngineDeadError):
        return APIError(f"The engine is not running: {e}", 503, "service_unavailable_error", None, "engine_dead")
    if isinstance(e, RequestError):
        param = e.param
        return bad_request(str(e), (param_names or {}).get(param, param), e.code)
    return None
