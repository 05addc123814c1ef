"""The one place that turns things into wire text: chat messages -> prompt (the checkpoint's chat
template, through the engine's tokenizer) and response objects -> Server-Sent Events frames."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from linrnn_server.errors import APIError, bad_request
from linrnn_server.protocol import ChatMessage
from linrnn_server.serving import cancel_on_disconnect

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


def sse_frame(obj: BaseModel | dict[str, Any]) -> bytes:
    """One `data: <json>` event. Nulls are kept: OpenAI chunks carry e.g. `"finish_reason": null`."""
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return b"data: " + data.encode("utf-8") + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response whose frames are sent by the task that ran the route. Starlette's
    StreamingResponse (under ASGI spec < 2.4, and uvicorn reports 2.3) sends them from a new task while
    the route's task waits for a disconnect: the first frame (the first token) then waits for one more
    turn of an event loop busy with every other stream. Here the disconnect listener is the extra task;
    a disconnect still cancels the stream (its generator's cleanup aborts the request)."""

    def __init__(self, content, headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})

    async def stream_response(self, send: Send) -> None:
        """Starlette's, except that a frame ending with [DONE] (a stream's end, sse_error's too) also ends the
        response: the HTTP server writes it with the chunked encoding's terminator in one write, where a
        separate empty last message cost one more write per stream (64 at once when a c = 64 wave ends)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self.body_iterator
        async for chunk in body:
            if not isinstance(chunk, (bytes, memoryview)):
                chunk = chunk.encode(self.charset)
            if chunk.endswith(SSE_DONE):
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                aclose = getattr(body, "aclose", None)
                if aclose is not None:  # nothing follows [DONE]: end the generator now, not at collection
                    await aclose()
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
        if scope["type"] != "http" or spec >= (2, 4):  # no disconnect listener needed: Starlette's own path
            return await super().__call__(scope, receive, send)
        await cancel_on_disconnect(receive, self.stream_response(send))  # a disconnect ends the body quietly
        if self.background is not None:
            await self.background()


def sse_error(err: APIError) -> bytes:
    """An error after the stream started (headers already sent): an error event, then [DONE]."""
    return sse_frame(err.body()) + SSE_DONE


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: plain dicts, text content joined, no nulls.
    'developer' (OpenAI's newer name for the system role) is given to the template as 'system'.
    Tool calls in the history carry their arguments as a JSON string (OpenAI); templates (Qwen's
    iterate `arguments|items`) get them parsed into a dict, as vLLM does."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text() or ""}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            v = getattr(m, key)
            if v is not None:
                d[key] = v
        if m.tool_calls:
            d["tool_calls"] = [_parsed_arguments(tc) for tc in m.tool_calls]
        out.append(d)
    return out


def _parsed_arguments(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return tc
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except json.JSONDecodeError:
        return tc
    return {**tc, "function": {**fn, "arguments": args}}


def render_chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
                       chat_template: str | None = None, documents: list[dict] | None = None) -> str:
    """The prompt text for a chat request, rendered with `chat_template` (--chat-template or the
    request's) or else the checkpoint's own; `tools` and `chat_template_kwargs` (e.g. enable_thinking)
    reach the template."""
    if continue_final_message and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request("'continue_final_message' needs a final assistant message", "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "continue_final_message", "tokenize", "chat_template",
                     "tools", "documents"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs may not set '{reserved}'", "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(message_dicts(messages), add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools or None,
                                             documents=documents, chat_template=chat_template, **kwargs)
    except APIError:
        raise
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template), missing template
        raise bad_request(f"Cannot apply the model's chat template to these messages: {e}", "messages",
                          "chat_template_error") from e
