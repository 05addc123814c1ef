"""Tool-call parsers (vLLM's `--tool-call-parser`): model text -> OpenAI `tool_calls`, streaming or not.

Two call styles of the Qwen family:

* `qwen3_coder` (Qwen3-Coder, Qwen3.5, Qwen3-Next templates): XML-ish, parameter values raw text
      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>
  Values are typed by the tool's JSON schema (string stays text; integer / number / boolean / object /
  array / null are parsed; unknown types: JSON if it parses, else text). One leading and one trailing
  newline of a value are dropped (the template writes them).
* `hermes` (Qwen2.5 / Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Streaming (`feed(delta) -> ToolDelta list`): text before the first `<tool_call>` streams as content; a
call's `id`, `type` and `function.name` come in one delta as soon as the name is known, then
`function.arguments` streams as the model writes it (vLLM's qwen3_coder parser sends each parameter
only when it is complete, vllm#30439): for qwen3_coder, string values stream character by character
(JSON-escaped), other types when their `</parameter>` arrives; for hermes, the raw JSON of the
`arguments` object streams as it is generated. The concatenated `arguments` of a call is exactly the
one-shot parser's string, and it is valid JSON. A tag split across deltas is held back, never emitted
as content. Text after a call (between / after calls) is dropped like vLLM does, except whitespace.

`finish()` flushes: an unterminated call at the end of generation (max_tokens) is parsed as far as it
goes when it is complete enough (name known); otherwise its text is returned as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from linrnn_serve.parsers.reasoning import _partial_suffix

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("qwen3_coder", "hermes")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolDelta:
    """One streaming piece: content text, or a piece of tool call `index`."""

    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Call:
    id: str
    name: str | None = None
    args: str = ""  # arguments emitted so far
    done: bool = False
    extra: dict = field(default_factory=dict)


def _param_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """function name -> {parameter: JSON-schema type}."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        types = {}
        for k, v in props.items():
            ty = v.get("type") if isinstance(v, dict) else None
            if isinstance(ty, list):
                ty = next((x for x in ty if x != "null"), "string")
            if ty is None and isinstance(v, dict) and ("anyOf" in v or "oneOf" in v):
                ty = "any"
            types[k] = ty or "any"
        out[fn.get("name", "")] = types
    return out


def convert_param(raw: str, ty: str) -> Any:
    """A qwen3_coder parameter's text -> its JSON value, by the schema type."""
    if ty == "string":
        return raw
    s = raw.strip()
    if ty == "integer":
        try:
            return int(s)
        except ValueError:
            pass
    if ty == "number":
        try:
            v = float(s)
            return int(v) if v.is_integer() and "." not in s and "e" not in s.lower() else v
        except ValueError:
            pass
    if ty == "boolean" and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if ty == "null" and s.lower() in ("null", "none"):
        return None
    try:
        return json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return raw


class ToolCallParser:
    """Base: splits content from <tool_call> blocks; subclasses parse a block's body incrementally."""

    def __init__(self, tools: list[dict] | None = None):
        self.types = _param_types(tools)
        self.buf = ""
        self.calls: list[_Call] = []
        self.in_call = False
        self.content_seen = False

    # ---- streaming ------------------------------------------------------------------------
    def feed(self, delta: str) -> list[ToolDelta]:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> list[ToolDelta]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        while True:
            if not self.in_call:
                i = self.buf.find(TOOL_CALL_START)
                if i < 0:
                    hold = 0 if final else _partial_suffix(self.buf, (TOOL_CALL_START,))
                    text, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                    if self.calls:  # between / after calls: only whitespace, which is dropped
                        text = ""
                    if text:
                        out.append(ToolDelta(content=text))
                    return out
                text = self.buf[:i]
                if text and not self.calls:
                    out.append(ToolDelta(content=text))
                self.buf = self.buf[i + len(TOOL_CALL_START):]
                self.in_call = True
                self.calls.append(_Call(new_call_id()))
                continue
            call = self.calls[-1]
            j = self.buf.find(TOOL_CALL_END)
            body_end = j if j >= 0 else len(self.buf)
            out += self._body(len(self.calls) - 1, call, self.buf[:body_end], complete=j >= 0 or final)
            if j < 0:
                if final:
                    self.buf = ""
                    self.in_call = False
                    if call.name is None:  # nothing usable: give the text back as content
                        self.calls.pop()
                        raw = call.extra.get("raw", "")
                        if raw.strip() or not self.calls:
                            out.append(ToolDelta(content=TOOL_CALL_START + raw))
                return out
            self.buf = self.buf[j + len(TOOL_CALL_END):]
            self.in_call = False

    def _body(self, index: int, call: _Call, body: str, complete: bool) -> list[ToolDelta]:
        raise NotImplementedError

    # ---- one shot ---------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, tool calls) of a whole output."""
        content, calls = "", {}
        for d in self.feed(text) + self.finish():
            content += d.content
            if d.index is not None:
                c = calls.setdefault(d.index, ToolCall(d.id or "", d.name or "", ""))
                c.id, c.name = d.id or c.id, d.name or c.name
                c.arguments += d.arguments
        return (content if content.strip() or not calls else None), [calls[i] for i in sorted(calls)]


_FUNC = re.compile(r"<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>")


class Qwen3CoderParser(ToolCallParser):
    """`<function=NAME><parameter=KEY>value</parameter>...</function>`; arguments streamed."""

    def _body(self, index: int, call: _Call, body: str, complete: bool) -> list[ToolDelta]:
        st = call.extra
        st["raw"] = body
        out: list[ToolDelta] = []
        pos = st.get("pos", 0)
        if call.name is None:
            m = _FUNC.search(body, pos)
            if not m:
                return out
            call.name = m.group(1).strip()
            st.update(pos=m.end(), nparams=0, param=None)
            out.append(ToolDelta(index=index, id=call.id, name=call.name))
            pos = m.end()
        types = self.types.get(call.name, {})

        def emit(s: str):
            if s:
                call.args += s
                out.append(ToolDelta(index=index, arguments=s))

        while not call.done:
            if st["param"] is None:
                m = _PARAM.search(body, pos)
                f_end = body.find("</function>", pos)
                if m and (f_end < 0 or m.start() < f_end):
                    key = m.group(1).strip()
                    ty = types.get(key, "any")
                    st.update(param=key, ptype=ty, vstart=m.end(), sent=0, lead=None)
                    emit(("{" if st["nparams"] == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
                    st["nparams"] += 1
                    pos = m.end()
                    if ty == "string":
                        emit('"')
                    continue
                if f_end >= 0 or complete:
                    emit("{}" if st["nparams"] == 0 else "}")
                    call.done = True
                    pos = f_end + len("</function>") if f_end >= 0 else len(body)
                break
            # inside a parameter value
            vstart = st["vstart"]
            end = body.find("</parameter>", vstart)
            nxt = _PARAM.search(body, vstart)  # a missing </parameter>: the next one closes it
            f_end = body.find("</function>", vstart)
            stops = [x for x in (end, nxt.start() if nxt else -1, f_end) if x >= 0]
            closed = bool(stops) or complete
            vend = min(stops) if stops else len(body)
            raw = body[vstart:vend]
            if closed:
                value = _strip_value(raw)
                if st["ptype"] == "string":
                    emit(_esc(value[st["sent"]:]) + '"')
                else:
                    emit(json.dumps(convert_param(value, st["ptype"]), ensure_ascii=False))
                st["param"] = None
                pos = vend + len("</parameter>") if vend == end else vend
                continue
            if st["ptype"] == "string":
                # stream the value, minus the leading newline and a tail that may be "\n</parameter>"
                hold = _partial_suffix(raw, ("\n</parameter>", "</parameter>", "<parameter=", "</function>"))
                if raw.endswith("\n"):
                    hold = max(hold, 1)
                avail = raw[:len(raw) - hold]
                if avail.startswith("\n"):
                    avail = avail[1:]
                elif raw == "" or (raw == "\n"[:len(raw)]):
                    avail = ""
                if len(avail) > st["sent"]:
                    emit(_esc(avail[st["sent"]:]))
                    st["sent"] = len(avail)
            pos = vstart
            break
        st["pos"] = pos
        return out


def _strip_value(raw: str) -> str:
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _esc(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the arguments object streamed raw."""

    _NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
    _ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def _body(self, index: int, call: _Call, body: str, complete: bool) -> list[ToolDelta]:
        st = call.extra
        st["raw"] = body
        out: list[ToolDelta] = []
        if call.done:
            return out
        if complete:  # the whole object: parse it properly
            try:
                obj = json.loads(body.strip())
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters", {}))
                full = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                if call.name is None:
                    call.name = obj["name"]
                    out.append(ToolDelta(index=index, id=call.id, name=call.name))
                if not full.startswith(call.args):  # streamed raw text differs from the canonical form
                    full = call.args + full[len(call.args):] if _valid(call.args + full[len(call.args):]) \
                        else call.args
                rest = full[len(call.args):]
                if rest:
                    out.append(ToolDelta(index=index, arguments=rest))
                    call.args += rest
                call.done = True
                return out
        if call.name is None:
            m = self._NAME.search(body)
            if not m:
                return out
            call.name = json.loads(f'"{m.group(1)}"')
            out.append(ToolDelta(index=index, id=call.id, name=call.name))
        m = self._ARGS.search(body)
        if not m or m.end() >= len(body) or body[m.end()] != "{":
            return out
        # stream the arguments object up to where its braces balance (string-aware scan)
        raw = body[m.end():]
        n = _json_object_prefix(raw)
        if complete or n == len(raw) and _valid(raw[:n]):
            pass
        piece = raw[len(call.args):n] if n > len(call.args) else ""
        if piece and raw.startswith(call.args):
            call.args += piece
            out.append(ToolDelta(index=index, arguments=piece))
        return out


def _valid(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except json.JSONDecodeError:
        return False


def _json_object_prefix(s: str) -> int:
    """Length of the prefix of `s` (starting with '{') that belongs to that object: up to its closing
    brace, or all of `s` while it is still open (minus trailing whitespace, which may be the end)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s.rstrip()) if not in_str else len(s)


def make_tool_parser(name: str, tools: list[dict] | None = None) -> ToolCallParser:
    if name == "qwen3_coder":
        return Qwen3CoderParser(tools)
    if name in ("hermes", "qwen3_json"):
        return HermesParser(tools)
    raise ValueError(f"unknown tool call parser {name!r} (available: {', '.join(TOOL_CALL_PARSERS)})")
