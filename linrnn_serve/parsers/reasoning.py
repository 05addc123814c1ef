"""Reasoning parsers: split a model's `<think>...</think>` block from its answer (vLLM's
`--reasoning-parser`). Plain Python over text, no tokenizer: the same code serves the HTTP server
(streaming and not) and `LLM.chat`.

    p = make_reasoning_parser("qwen3", prompt_text)        # or "deepseek_r1"
    for delta in text_deltas: reasoning, content = p.feed(delta)
    reasoning, content = p.finish()                       # whatever was held back

Streaming never emits a partial tag: a tail that could still become `<think>` / `</think>` is held
back until the next delta decides it, so the concatenated deltas equal the one-shot split for every
way of cutting the text (tests cut at every byte).

Where reasoning starts (why it needs the prompt):
- `qwen3`: Qwen3 / Qwen3.5 / Qwen3-Next templates in thinking mode end the prompt with `<think>\\n`,
  so the output begins inside the reasoning with no opening tag; older ones let the model write
  `<think>` itself. So the output is reasoning until `</think>` when the prompt ends with an open
  `<think>` or the output starts with `<think>`; otherwise (e.g. `enable_thinking: false`, whose
  template closes an empty block in the prompt) it is all content.
- `deepseek_r1`: always starts inside the reasoning.
A `</think>` that never comes (max_tokens reached while thinking) leaves everything in reasoning.

A tool call inside <think> (vLLM#39056): when `tool_call_start` is given (tools are enabled), that
tag also ends the reasoning: the call and what follows go to the content (and so to the tool-call
parser) instead of being lost in reasoning_content; a stray `</think>` after it is dropped.
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ReasoningParser:
    """Streaming <think> splitter. States: 'start' (may still see an opening <think>), 'reasoning',
    'content'."""

    def __init__(self, starts_in_reasoning: bool, tool_call_start: str | None = None):
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.tool_call_start = tool_call_start
        self.buf = ""
        self._drop_end = False  # after a tool call ended the reasoning: drop a later </think>

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """One-shot split: (reasoning or None, content or None), as vLLM returns them."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        r, c = r1 + r2, c1 + c2
        return (r if r or self.saw_reasoning else None), (c or None)

    @property
    def saw_reasoning(self) -> bool:
        return self.state != "start" and self._reasoned

    _reasoned = False

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.buf = stripped[len(THINK_START):]
                    self.state = "reasoning"
                    self._reasoned = True
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # might still be "<think>"
                self.state = "content"
                continue
            if self.state == "reasoning":
                self._reasoned = True
                ends = [(self.buf.find(THINK_END), THINK_END, False)]
                if self.tool_call_start:
                    ends.append((self.buf.find(self.tool_call_start), self.tool_call_start, True))
                hits = [e for e in ends if e[0] >= 0]
                if hits:
                    i, tag, is_call = min(hits)
                    reasoning += self.buf[:i]
                    self.buf = self.buf[i:] if is_call else self.buf[i + len(tag):]
                    self.state = "content"
                    self._drop_end = is_call
                    continue
                hold = 0 if final else _partial_suffix(self.buf, tuple(t for _, t, _ in ends))
                reasoning += self.buf[:len(self.buf) - hold]
                self.buf = self.buf[len(self.buf) - hold:]
                break
            # content
            if self._drop_end:
                i = self.buf.find(THINK_END)
                if i >= 0:
                    content += self.buf[:i]
                    self.buf = self.buf[i + len(THINK_END):]
                    self._drop_end = False
                    continue
                hold = 0 if final else _partial_suffix(self.buf, (THINK_END,))
                content += self.buf[:len(self.buf) - hold]
                self.buf = self.buf[len(self.buf) - hold:]
                break
            content += self.buf
            self.buf = ""
        return reasoning, content


REASONING_PARSERS = ("qwen3", "deepseek_r1")


def prompt_opens_thinking(prompt_text: str | None) -> bool:
    """The prompt ends inside an open <think> block (the chat template put the model in thinking mode)."""
    if not prompt_text:
        return False
    i, j = prompt_text.rfind(THINK_START), prompt_text.rfind(THINK_END)
    return i >= 0 and i > j and not prompt_text[i + len(THINK_START):].strip()


def make_reasoning_parser(name: str, prompt_text: str | None = None,
                          tool_call_start: str | None = None) -> ReasoningParser:
    if name == "qwen3":
        return ReasoningParser(prompt_opens_thinking(prompt_text), tool_call_start)
    if name == "deepseek_r1":
        return ReasoningParser(True, tool_call_start)
    raise ValueError(f"unknown reasoning parser {name!r} (available: {', '.join(REASONING_PARSERS)})")


def starts_in_reasoning(name: str | None, prompt_text: str | None) -> bool:
    """The output of this prompt begins inside a reasoning block (what `make_reasoning_parser` decides)."""
    return name == "deepseek_r1" or (name == "qwen3" and prompt_opens_thinking(prompt_text))


def gate_constraint(so, reasoning_parser: str | None, prompt_text: str | None, enable_in_reasoning: bool = False):
    """A structured-output constraint for this prompt: when the output starts inside a reasoning block, the
    grammar waits for `</think>` (vLLM's default, `enable_in_reasoning` false), so the thinking is free and
    the answer after it is constrained. Otherwise (no reasoning parser, a template without thinking) it
    applies from the first token. `so`: a StructuredOutputsParams or None; returns a copy or `so`."""
    if so is None or enable_in_reasoning or not starts_in_reasoning(reasoning_parser, prompt_text):
        return so
    import dataclasses

    return dataclasses.replace(so, reasoning_end=THINK_END)
