"""Reasoning and tool-call parsers on recorded Qwen3.5-style outputs; streaming cut at every position
gives exactly the one-shot result."""
from __future__ import annotations

import json

import pytest

from linrnn_serve.parsers.reasoning import make_reasoning_parser
from linrnn_serve.parsers.tool_calls import make_tool_parser

THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
PLAIN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

# a Qwen3.5 thinking-mode answer (the prompt opened <think>)
QWEN35_THINK = "The user greets me. I should answer briefly.\n</think>\n\nHello! How can I help you today?"
QWEN3_OPEN = "<think>\nLet me think about 2+2.\n</think>\n\n2 + 2 = 4."
CODER_CALL = ("I'll check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, \"FR\"\n"
              "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"temp\": \"C\"}\n</parameter>\n"
              "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>")
HERMES_CALL = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 3, '
               '"units": {"temp": "C"}}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def _stream_reasoning(name, prompt, text, cut, tool_start=None):
    p = make_reasoning_parser(name, prompt, tool_start)
    r, c = "", ""
    for piece in (text[:cut], text[cut:]):
        dr, dc = p.feed(piece)
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    return r + dr, c + dc


@pytest.mark.parametrize("prompt,text,want", [
    (THINKING_PROMPT, QWEN35_THINK, ("The user greets me. I should answer briefly.\n",
                                     "\n\nHello! How can I help you today?")),
    (PLAIN_PROMPT, QWEN3_OPEN, ("\nLet me think about 2+2.\n", "\n\n2 + 2 = 4.")),
    (PLAIN_PROMPT, "Just an answer, no thinking.", (None, "Just an answer, no thinking.")),
    (THINKING_PROMPT, "still thinking when max_tokens hit", ("still thinking when max_tokens hit", None)),
    (PLAIN_PROMPT + "<think>\n\n</think>\n\n", "Direct answer.", (None, "Direct answer.")),  # enable_thinking=False
])
def test_reasoning_split(prompt, text, want):
    assert make_reasoning_parser("qwen3", prompt).parse(text) == want
    for cut in range(len(text) + 1):  # every split point (ASCII text: every byte)
        r, c = _stream_reasoning("qwen3", prompt, text, cut)
        assert (r or None, c or None) == (want[0] or None, want[1]), cut


def test_reasoning_streaming_one_char_at_a_time_utf8():
    text = "Überlegung: 日本語 ✓\n</think>\n\nAntwort: ja 🙂"
    p = make_reasoning_parser("qwen3", THINKING_PROMPT)
    parts = [p.feed(ch) for ch in text] + [p.finish()]
    assert "".join(r for r, _ in parts) == "Überlegung: 日本語 ✓\n"
    assert "".join(c for _, c in parts) == "\n\nAntwort: ja 🙂"
    assert not any("<" in c for _, c in parts)


def test_deepseek_r1_starts_in_reasoning():
    assert make_reasoning_parser("deepseek_r1").parse("a</think>b") == ("a", "b")
    with pytest.raises(ValueError):
        make_reasoning_parser("nope")


def test_tool_call_inside_think_ends_the_reasoning():
    text = "I need the weather.\n<tool_call>\n<function=now>\n</function>\n</tool_call></think>"
    for cut in range(len(text) + 1):
        r, c = _stream_reasoning("qwen3", THINKING_PROMPT, text, cut, "<tool_call>")
        assert r == "I need the weather.\n" and c == "<tool_call>\n<function=now>\n</function>\n</tool_call>", cut


def _stream_tools(name, text, cuts):
    p = make_tool_parser(name, TOOLS)
    deltas, prev = [], 0
    for cut in list(cuts) + [len(text)]:
        deltas += p.feed(text[prev:cut])
        prev = cut
    deltas += p.finish()
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index is not None:
            c = calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": "", "pieces": 0})
            assert d.name is None or c["name"] == d.name
            c["arguments"] += d.arguments
            c["pieces"] += bool(d.arguments)
    return content, [calls[i] for i in sorted(calls)]


WANT_ARGS = [{"city": 'Paris, "FR"', "days": 3, "units": {"temp": "C"}}, {}]


@pytest.mark.parametrize("name,text,content", [("qwen3_coder", CODER_CALL, "I'll check the weather.\n"),
                                               ("hermes", HERMES_CALL, "Sure.\n")])
def test_tool_calls_one_shot_and_streamed_at_every_cut(name, text, content):
    got_content, calls = make_tool_parser(name, TOOLS).parse(text)
    assert got_content == content
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert [json.loads(c.arguments) for c in calls] == WANT_ARGS
    for cut in range(len(text) + 1):
        c, streamed = _stream_tools(name, text, [cut])
        assert c == content, cut
        assert [s["arguments"] for s in streamed] == [x.arguments for x in calls], cut
    # one character at a time: the arguments arrive in many pieces (streamed as generated)
    c, streamed = _stream_tools(name, text, range(1, len(text)))
    assert streamed[0]["pieces"] > 5 and [s["name"] for s in streamed] == ["get_weather", "now"]
    assert all(s["id"] and s["id"].startswith("call_") for s in streamed)


def test_no_tool_call_is_all_content():
    for name in ("qwen3_coder", "hermes"):
        assert make_tool_parser(name, TOOLS).parse("plain <b>answer</b> < x") == ("plain <b>answer</b> < x", [])


def test_unterminated_call_at_max_tokens():
    content, calls = make_tool_parser("qwen3_coder", TOOLS).parse(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer")
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Ber"}
    content, calls = make_tool_parser("hermes", TOOLS).parse("<tool_call>\n{\"na")
    assert calls == [] and content == "<tool_call>\n{\"na"
