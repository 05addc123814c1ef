"""Tools and tool_choice of a chat request -> how its output is constrained and parsed.

    none       tools reach the template; the output is plain content (no parsing)
    auto       the model decides; needs --enable-auto-tool-choice --tool-call-parser NAME, whose parser
               (linrnn_serve/parsers/tool_calls.py) turns <tool_call> text into tool_calls (streamed)
    required   structured decoding forces a JSON array of calls, [{"name": ..., "parameters": {...}}, ...]
               (vLLM's schema; at most one call with parallel_tool_calls=false), returned as tool_calls
    {"type": "function", "function": {"name": F}}
               structured decoding forces F's parameters schema; the output is F's arguments
When `tools` is sent without `tool_choice`, OpenAI's default is 'auto'; a server started without
--enable-auto-tool-choice then answers as 'none' (an explicit 'auto' is a 400 there, as vLLM).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from linrnn_serve.parsers import ToolCall, new_call_id
from linrnn_serve.sampling_params import StructuredOutputsParams
from linrnn_server.errors import bad_request


@dataclass
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    tools: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None  # named
    constraint: StructuredOutputsParams | None = None


def _fn(tool: dict) -> dict:
    return tool.get("function", {}) if isinstance(tool, dict) else {}


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None, auto_enabled: bool,
               has_constraint: bool) -> ToolPlan:
    tools = list(tools or [])
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(_fn(t).get("name"),
                                                                                                  str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                              f"...}}}}", "tools", "invalid_value")
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs a non-empty 'tools' list", "tool_choice", "invalid_value")
        return ToolPlan()
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not auto_enabled:
            if tool_choice is None:
                return ToolPlan("none", tools)
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                              "tool_choice", "invalid_value")
        return ToolPlan("auto", tools)
    if has_constraint:
        raise bad_request("tool_choice 'required' or a named function cannot be combined with response_format / "
                          "structured outputs", "tool_choice", "invalid_value")
    if choice == "required":
        alts = [{"type": "object", "properties": {"name": {"type": "string", "enum": [_fn(t)["name"]]},
                                                  "parameters": _fn(t).get("parameters") or {"type": "object"}},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": alts[0] if len(alts) == 1 else
                                  {"anyOf": alts}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema))
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        name = (choice.get("function") or {}).get("name", choice.get("name"))
        match = [t for t in tools if _fn(t).get("name") == name]
        if not match:
            raise bad_request(f"tool_choice names function {name!r}, which is not in 'tools'", "tool_choice",
                              "invalid_value")
        params = _fn(match[0]).get("parameters") or {"type": "object", "properties": {}}
        return ToolPlan("named", tools, name=name, constraint=StructuredOutputsParams(json=params))
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                      "tool_choice", "invalid_value")


def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls of a 'required' / named output (None when the output is not a complete call, e.g.
    cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if plan.mode == "named":
        return [ToolCall(new_call_id(), plan.name, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return None
    return [ToolCall(new_call_id(), c.get("name", ""), json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in value if isinstance(c, dict)]
