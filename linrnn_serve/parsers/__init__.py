"""Output parsers of chat completions: reasoning (`reasoning.py`) and tool calls (`tool_calls.py`),
combined per choice by `ChatOutputParser`. Plain Python over text: the server and `LLM.chat` share it."""
from __future__ import annotations

from dataclasses import dataclass, field

from linrnn_serve.parsers.reasoning import REASONING_PARSERS, make_reasoning_parser
from linrnn_serve.parsers.tool_calls import (TOOL_CALL_PARSERS, TOOL_CALL_START, ToolCall, ToolDelta,
                                             make_tool_parser, new_call_id)

__all__ = ["ChatOutputParser", "ChatDelta", "ToolCall", "ToolDelta", "REASONING_PARSERS", "TOOL_CALL_PARSERS",
           "new_call_id"]


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Model text -> reasoning / content / tool calls, streaming (`feed`, `finish`) or at once (`parse`).
    Reasoning is split first; only the text after it (the answer) is searched for tool calls."""

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 tools: list[dict] | None = None, prompt_text: str | None = None):
        self.tools = make_tool_parser(tool_parser, tools) if tool_parser else None
        self.reasoning = make_reasoning_parser(reasoning_parser, prompt_text,
                                               TOOL_CALL_START if self.tools else None) if reasoning_parser else None
        self.saw_tool_calls = False

    def feed(self, text: str) -> ChatDelta:
        return self._step(text, final=False)

    def finish(self) -> ChatDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ChatDelta:
        out = ChatDelta()
        answer = text
        if self.reasoning is not None:
            r, answer = self.reasoning.finish() if final and not text else self.reasoning.feed(text)
            if final and text:
                r2, a2 = self.reasoning.finish()
                r, answer = r + r2, answer + a2
            out.reasoning = r
        if self.tools is None:
            out.content = answer
            return out
        deltas = self.tools.feed(answer) if answer else []
        if final:
            deltas += self.tools.finish()
        for d in deltas:
            if d.index is None:
                out.content += d.content
            else:
                out.tool_calls.append(d)
                self.saw_tool_calls = True
        return out

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a whole output, as vLLM returns them."""
        a, b = self.feed(text), self.finish()
        reasoning = a.reasoning + b.reasoning
        content = a.content + b.content
        calls: dict[int, ToolCall] = {}
        for d in a.tool_calls + b.tool_calls:
            c = calls.setdefault(d.index, ToolCall(d.id or "", d.name or "", ""))
            c.id, c.name = d.id or c.id, d.name or c.name
            c.arguments += d.arguments
        if calls and not content.strip():
            content = ""
        return reasoning or None, content or None, [calls[i] for i in sorted(calls)]
