"""POST /v1/responses: the OpenAI Responses API (the `openai` client's `responses.create`) over the chat
machinery: text and message-list input, `instructions`, function tools (flat `{"type": "function",
"name", "parameters"}`), `tool_choice`, `function_call` / `function_call_output` items in the input,
`text.format` JSON schemas, `reasoning` (with --reasoning-parser the <think> part becomes a reasoning
item), `max_output_tokens`, and streaming as typed server-sent events (response.created ...
response.output_text.delta ... response.completed). Responses are not stored: `previous_response_id`
and `background` are refused.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from linrnn_server.errors import APIError, bad_request, from_engine_error, from_validation_error, internal
from linrnn_server.protocol import ChatCompletionRequest
from linrnn_server.rendering import EventStreamResponse
from linrnn_server.routes.chat import _ChoiceStream, final_message, prepare_chat
from linrnn_server.serving import (Generation, check_model, new_id, state_of, until_disconnect,
                                   usage_of)

log = logging.getLogger(__name__)
router = APIRouter()
# the engine's names of the fields it checks -> this route's (Generation.param_names)
PARAM_NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}

_IGNORED = {"store", "metadata", "user", "service_tier", "truncation", "include", "prompt_cache_key",
            "safety_identifier", "top_logprobs", "stream_options", "background", "previous_response_id"}


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"):
            parts.append(p.get("text", ""))
        elif isinstance(p, dict):
            raise bad_request(f"input content type {p.get('type')!r} is not supported (text only)", "input",
                              "unsupported_parameter")
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
        return msgs
    if not isinstance(inp, list) or not inp:
        raise bad_request("'input' must be a string or a non-empty list of input items", "input", "invalid_value")
    for item in inp:
        if not isinstance(item, dict):
            raise bad_request("each input item must be an object", "input", "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role", "user"), "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input item type {kind!r} is not supported", "input", "unsupported_parameter")
    return msgs


def _chat_body(body: dict) -> dict:
    for key in ("previous_response_id", "background"):
        if body.get(key):
            raise bad_request(f"'{key}' is not supported: responses are not stored", key, "unsupported_parameter")
    chat: dict[str, Any] = {"messages": _messages(body), "stream": bool(body.get("stream"))}
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("max_output_tokens", "max_completion_tokens"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("seed", "seed"), ("top_k", "top_k"), ("chat_template_kwargs", "chat_template_kwargs")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"tool type {t.get('type') if isinstance(t, dict) else t!r} is not supported (function "
                              f"tools only)", "tools", "unsupported_parameter")
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                       if k in t}})
    if tools:
        chat["tools"] = tools
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        tc = {"type": "function", "function": {"name": tc.get("name")}}
    if tc is not None:
        chat["tool_choice"] = tc
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                          "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort:
        chat["reasoning_effort"] = effort
    return chat


class _Builder:
    """Output items of one response, from chat deltas (reasoning / content / tool-call pieces)."""

    def __init__(self):
        self.items: list[dict] = []
        self.events: list[dict] = []
        self.open: tuple[str, int | None] | None = None  # (kind, tool index)

    def _close(self):
        if self.open is None:
            return
        item = self.items[-1]
        oi = len(self.items) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            self.events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": oi,
                             "content_index": 0, "text": part["text"], "logprobs": []},
                            {"type": "response.content_part.done", "item_id": item["id"], "output_index": oi,
                             "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            self.events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": oi,
                                "content_index": 0, "text": item["content"][0]["text"]})
        else:
            self.events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                "output_index": oi, "name": item["name"], "arguments": item["arguments"]})
        self.events.append({"type": "response.output_item.done", "output_index": oi, "item": json.loads(
            json.dumps(item))})
        self.open = None

    def _start(self, kind: str, tool: dict | None = None):
        self._close()
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": tool["id"], "status": "in_progress",
                    "name": tool["function"]["name"], "arguments": ""}
        self.items.append(item)
        oi = len(self.items) - 1
        added = json.loads(json.dumps(item))
        if kind == "message":
            added["content"] = []
        self.events.append({"type": "response.output_item.added", "output_index": oi, "item": added})
        if kind == "message":
            self.events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": oi,
                                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        self.open = (kind, tool.get("index") if tool else None)

    def add(self, reasoning: str | None, content: str | None, tool_calls: list[dict] | None):
        if reasoning:
            if self.open is None or self.open[0] != "reasoning":
                self._start("reasoning")
            item = self.items[-1]
            item["content"][0]["text"] += reasoning
            self.events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                                "output_index": len(self.items) - 1, "content_index": 0, "delta": reasoning})
        if content:
            if self.open is None or self.open[0] != "message":
                if not content.strip() and self.open is not None:  # whitespace between items
                    content = ""
                else:
                    self._start("message")
            if content:
                item = self.items[-1]
                item["content"][0]["text"] += content
                self.events.append({"type": "response.output_text.delta", "item_id": item["id"],
                                    "output_index": len(self.items) - 1, "content_index": 0, "delta": content,
                                    "logprobs": []})
        for tc in tool_calls or []:
            if tc.get("id") is not None:
                self._start("function_call", tc)
            if self.open is None or self.open[0] != "function_call":
                continue
            piece = tc.get("function", {}).get("arguments") or ""
            if piece:
                item = self.items[-1]
                item["arguments"] += piece
                self.events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                    "output_index": len(self.items) - 1, "delta": piece})

    def take_events(self) -> list[dict]:
        ev, self.events = self.events, []
        return ev


def _response(rid: str, created: int, model: str, body: dict, chat: ChatCompletionRequest, items: list[dict],
              status: str, usage: dict | None, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata"), "output": items, "parallel_tool_calls": chat.parallel_tool_calls
            is not False, "previous_response_id": None, "reasoning": body.get("reasoning"),
            "temperature": chat.temperature, "top_p": chat.top_p, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "usage": usage, "store": False}


def _usage(ro) -> dict:
    p, g = usage_of([ro]) if ro is not None else (0, 0)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": g,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + g}


@router.post("/v1/responses")
async def create_response(request: Request):
    state = state_of(request)
    eng = state.engine
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    unknown = sorted(set(body) - _IGNORED - {"model", "input", "instructions", "tools", "tool_choice", "stream",
                                             "temperature", "top_p", "max_output_tokens", "parallel_tool_calls",
                                             "text", "reasoning", "seed", "top_k",
                                             "chat_template_kwargs"})
    if unknown:
        log.warning("ignoring unknown request field(s): %s", ", ".join(unknown))
    try:
        chat = ChatCompletionRequest.model_validate(_chat_body(body))
    except ValidationError as e:
        raise from_validation_error(e, ChatCompletionRequest.TYPE_HINTS) from None
    model = check_model(state, chat.model)
    run = await prepare_chat(eng, chat)
    rid = new_id("resp")
    gen = Generation(state, rid, [run.ids], run.params, PARAM_NAMES)
    await until_disconnect(request, gen.start())
    created = int(time.time())
    if chat.stream:
        return EventStreamResponse(_stream(gen, body, chat, model, created, run))
    (ro,) = await until_disconnect(request, gen.final_outputs())
    c = ro.outputs[0]
    msg, finish = final_message(run, c.text, c.finish_reason)
    b = _Builder()
    b.add(msg.reasoning_content, msg.content, [{"index": i, **tc} for i, tc in enumerate(msg.tool_calls)])
    b._close()
    status = "incomplete" if finish == "length" else "completed"
    return JSONResponse(_response(rid, created, model, body, chat, b.items, status, _usage(ro), finish))


async def _stream(gen: Generation, body: dict, chat: ChatCompletionRequest, model: str, created: int,
                  run) -> AsyncIterator[bytes]:
    seq = 0

    def frame(ev: dict) -> bytes:
        nonlocal seq
        ev["sequence_number"] = seq
        seq += 1
        return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n".encode()

    rid = gen.base_id
    b = _Builder()
    st = _ChoiceStream(run)
    sent, last, finish = 0, None, None
    base = _response(rid, created, model, body, chat, [], "in_progress", None)
    yield frame({"type": "response.created", "response": base})
    yield frame({"type": "response.in_progress", "response": base})
    try:
        async for _, ro in gen.outputs():
            last = ro
            c = ro.outputs[0]
            piece = c.text[sent:]
            sent = len(c.text)
            d = st.delta(piece, c.finished)
            if d is not None:
                b.add(d.reasoning_content, d.content, d.tool_calls)
            for ev in b.take_events():
                yield frame(ev)
            if c.finished:
                finish = c.finish_reason
        b._close()
        for ev in b.take_events():
            yield frame(ev)
        status = "incomplete" if finish == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield frame({"type": kind, "response": _response(rid, created, model, body, chat, b.items, status,
                                                         _usage(last), finish)})
    except Exception as e:  # noqa: BLE001 - the stream has started: an error event
        err = e if isinstance(e, APIError) else (from_engine_error(e) or internal(e))
        if not isinstance(e, APIError):
            log.exception("stream %s failed", rid)
        yield frame({"type": "error", "code": err.code, "message": err.message, "param": err.param})
