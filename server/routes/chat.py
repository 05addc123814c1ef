"""POST /v1/chat/completions: messages rendered with the chat template (--chat-template, the request's
`chat_template`, else the checkpoint's own), tools and `chat_template_kwargs` passed to it; streaming deltas.

Output parsing (linrnn_serve/parsers): with --reasoning-parser the <think> part is returned as
`reasoning_content`; with tool_choice 'auto' (--enable-auto-tool-choice --tool-call-parser) tool calls
are returned as `tool_calls` (streamed as they are generated); 'required' and named tool_choice force
a call by structured decoding (server/tool_choice.py). response_format / structured_outputs / guided_*
constrain the output (engine/structured_output.py); with a reasoning parser and a prompt that opens a
<think> block, the constraint starts after `</think>` (vLLM's default; `--structured-outputs-config
'{"enable_in_reasoning": true}'` constrains from the first token), so the thinking is free and the
answer is constrained. A forced tool call is constrained from the first token.

`max_completion_tokens` wins over the deprecated `max_tokens`; with neither, generation may run to
the context limit (max_model_len - prompt tokens, as vLLM), or to --default-max-tokens if the server
sets it (serving.apply_default_max_tokens). `logprobs: true` returns each token's logprob, `top_logprobs: N` the N most
likely alternatives too (N <= 20).
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from linrnn_serve.engine.tokenizer import resolve_chat_template
from linrnn_serve.parsers import ChatOutputParser, new_call_id
from linrnn_serve.parsers.reasoning import gate_constraint, starts_in_reasoning
from linrnn_serve.sampling_params import SamplingParams
from linrnn_server.engine_client import EngineClient
from linrnn_server.errors import APIError, bad_request, from_engine_error, internal
from linrnn_server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs, DeltaMessage,
                                    TokenLogprob, TopLogprob, UsageInfo)
from linrnn_server.rendering import SSE_DONE, EventStreamResponse, render_chat_prompt, sse_error, sse_frame
from linrnn_server.tool_choice import ToolPlan, forced_calls, plan_tools
from linrnn_server.serving import (Generation, apply_default_max_tokens, check_model, clamp_logprob,
                                   new_id, parse_body, sampling_params, state_of, until_disconnect, usage_info)

log = logging.getLogger(__name__)
router = APIRouter()


def _token_logprobs(eng: EngineClient, token_ids: list[int], entries: list[dict[int, float]],
                    top_n: int, as_ids: bool | None = False) -> list[TokenLogprob]:
    """`as_ids` (vLLM's return_tokens_as_token_ids): tokens shown as 'token_id:N'."""
    name = (lambda t: f"token_id:{t}") if as_ids else eng.token_str
    out = []
    for tid, d in zip(token_ids, entries):
        d = d or {}
        top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        alts = [TopLogprob(token=name(k), logprob=clamp_logprob(v), bytes=list(eng.token_bytes(k)))
                for k, v in top]
        out.append(TokenLogprob(token=name(tid), logprob=clamp_logprob(d.get(tid)),
                                bytes=list(eng.token_bytes(tid)), top_logprobs=alts))
    return out


# the engine's names of the fields it checks -> this route's (Generation.param_names)
PARAM_NAMES = {"prompt": "messages", "logprobs": "top_logprobs"}


def _params(req: ChatCompletionRequest, eng: EngineClient) -> SamplingParams:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs", "invalid_value")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_request(f"max_completion_tokens must be a positive integer, got {req.max_completion_tokens}",
                          "max_completion_tokens", "invalid_value")
    return sampling_params(req, req.max_new_tokens, logprobs, engine=eng)


@dataclass
class ChatRun:
    """A chat request made ready: prompt ids, sampling params and how to parse its output."""

    ids: list[int]
    params: SamplingParams
    prompt_text: str
    tools: ToolPlan
    reasoning_parser: str | None
    tool_parser: str | None

    def parser(self) -> ChatOutputParser:
        # a constraint normally waits for the end of the reasoning (prepare_chat: gate_constraint); with
        # --structured-outputs-config '{"enable_in_reasoning": true}' a JSON grammar constrains the output
        # from its first token, so that answer is never inside a <think> block: parse it as content
        so = self.params.structured_outputs
        reasoning = None if so is not None and so.reasoning_end is None and so.kind() in ("json", "json_object") \
            and starts_in_reasoning(self.reasoning_parser, self.prompt_text) else self.reasoning_parser
        return ChatOutputParser(reasoning, self.tool_parser if self.tools.mode == "auto" else None,
                                self.tools.tools, self.prompt_text)


async def prepare_chat(eng: EngineClient, req: ChatCompletionRequest) -> ChatRun:
    """Template, tools / tool_choice, constraints and sampling params of a chat request (4xx on bad input).
    The template is rendered and tokenized in worker threads (the event loop keeps serving); messages
    too long for the context are refused before either."""
    cfg = eng.config
    params = _params(req, eng)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                       bool(_get(cfg, "enable_auto_tool_choice") and _get(cfg, "tool_call_parser")),
                       params.structured_outputs is not None)
    if tools.constraint is not None:
        params.structured_outputs = tools.constraint
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        template = resolve_chat_template(req.chat_template) if req.chat_template else eng.chat_template
    except ValueError as e:
        raise bad_request(str(e), "chat_template", "invalid_value") from None
    # the rendered prompt holds every message's text: one too long for the context is refused unrendered
    reserve = req.max_new_tokens or 1
    await eng.check_fits([m.text() or "" for m in req.messages], "messages", reserve)
    text = await eng.run_blocking(render_chat_prompt, eng.require_tokenizer("messages"), req.messages,
                                  req.add_generation_prompt, req.continue_final_message, kwargs, tools=tools.tools,
                                  chat_template=template, documents=req.documents)
    ids = await eng.encode_async(text, add_special_tokens=False, param="messages", reserve=reserve)
    if tools.constraint is None:  # a forced tool call (required / named) is constrained from the first token
        params.structured_outputs = gate_constraint(params.structured_outputs, _get(cfg, "reasoning_parser"), text,
                                                    bool(_get(cfg, "structured_outputs_enable_in_reasoning")))
    return ChatRun(ids, params, text, tools, _get(cfg, "reasoning_parser"), _get(cfg, "tool_call_parser"))


def _get(cfg, name):
    return getattr(cfg, name, None) if cfg is not None else None


def _tool_call_dicts(calls) -> list[dict]:
    return [c.to_openai() for c in calls]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request):
    state = state_of(request)
    eng = state.engine
    req = await parse_body(request, ChatCompletionRequest)
    req.check_neutral()
    model = check_model(state, req.model)
    run = await prepare_chat(eng, req)
    apply_default_max_tokens(state, run.params, len(run.ids))

    gen = Generation(state, new_id("chatcmpl"), [run.ids], run.params, PARAM_NAMES)
    await until_disconnect(request, gen.start())
    created = int(time.time())
    if req.stream:
        return EventStreamResponse(_stream(gen, req, model, created, eng, run))
    (ro,) = await until_disconnect(request, gen.final_outputs())
    top_n = req.top_logprobs or 0
    choices = []
    for c in ro.outputs:
        msg, finish = final_message(run, c.text, c.finish_reason)
        choices.append(ChatChoice(index=c.index, message=msg,
                                  logprobs=ChoiceLogprobs(content=_token_logprobs(
                                      eng, c.token_ids, c.logprobs or [], top_n, req.return_tokens_as_token_ids))
                                  if req.logprobs else None, finish_reason=finish, stop_reason=c.stop_reason))
    resp = ChatCompletionResponse(id=gen.base_id, created=created, model=model, choices=choices,
                                  usage=usage_info([ro]),
                                  prompt_logprobs=prompt_logprobs_json(eng, ro) if req.prompt_logprobs is not None
                                  else None)
    return JSONResponse(resp.model_dump())


def final_message(run: ChatRun, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The whole output as an assistant message (reasoning, content, tool calls) + its finish reason."""
    if run.tools.mode in ("required", "named"):
        calls = forced_calls(run.tools, text)
        if calls is not None:
            return AssistantMessage(content=None, tool_calls=_tool_call_dicts(calls)), \
                ("tool_calls" if finish_reason == "stop" and run.tools.mode == "required" else finish_reason)
        return AssistantMessage(content=text), finish_reason
    reasoning, content, calls = run.parser().parse(text)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return AssistantMessage(content=content if content is not None or calls else "", reasoning_content=reasoning,
                            tool_calls=_tool_call_dicts(calls)), finish_reason


class _ChoiceStream:
    """One choice's streaming state: the parser, and for a named / required call the forced-call deltas."""

    def __init__(self, run: ChatRun):
        self.run = run
        self.parser = run.parser() if run.tools.mode in ("none", "auto") else None
        self.text = ""
        self.call_id = new_call_id()
        self.saw_calls = False

    def delta(self, piece: str, final: bool, new_tokens: bool = False) -> DeltaMessage | None:
        """The chunk's delta; None: nothing to send. Plain content (no reasoning / tool parser) sends a delta
        for every output with new tokens, empty when they add no text yet (as vLLM: one chunk per step)."""
        mode = self.run.tools.mode
        if mode == "named":  # the output is the arguments: stream them as they come
            if not piece and not final:
                return None
            first = not self.text
            self.text += piece
            tc = {"index": 0, "function": {"arguments": piece}}
            if first:
                tc.update(id=self.call_id, type="function")
                tc["function"]["name"] = self.run.tools.name
            self.saw_calls = True
            return DeltaMessage(tool_calls=[tc]) if piece or first else None
        if mode == "required":  # a JSON array of calls: sent whole once complete
            self.text += piece
            if not final:
                return None
            calls = forced_calls(self.run.tools, self.text)
            if calls is None:
                return DeltaMessage(content=self.text) if self.text else None
            self.saw_calls = True
            return DeltaMessage(tool_calls=[{"index": i, **c.to_openai()} for i, c in enumerate(calls)])
        d = self.parser.feed(piece) if piece else None
        if final:
            f = self.parser.finish()
            d = f if d is None else type(f)(d.reasoning + f.reasoning, d.content + f.content,
                                             d.tool_calls + f.tool_calls)
        if not d:
            plain = self.parser.reasoning is None and self.parser.tools is None
            return DeltaMessage(content="") if plain and new_tokens else None
        tcs = []
        for t in d.tool_calls:
            item: dict = {"index": t.index, "function": {"arguments": t.arguments}}
            if t.id is not None:
                item.update(id=t.id, type="function")
                item["function"]["name"] = t.name
            tcs.append(item)
        self.saw_calls = self.saw_calls or bool(tcs)
        return DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None,
                            tool_calls=tcs or None)


async def _stream(gen: Generation, req: ChatCompletionRequest, model: str, created: int,
                  eng: EngineClient, run: ChatRun) -> AsyncIterator[bytes]:
    top_n = req.top_logprobs or 0
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    states: dict[int, _ChoiceStream] = {}
    last = None

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse_frame(ChatCompletionChunk(id=gen.base_id, created=created, model=model, choices=choices,
                                             usage=usage))

    def usage() -> UsageInfo:
        return usage_info([last]) if last is not None else UsageInfo()

    tail: list[bytes] = []  # the last choice's final frame, held to go out with usage and [DONE] in one write
    try:
        for i in range(req.num_samples):  # the role first, as OpenAI does
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for _, ro in gen.outputs():
            last = ro
            for c in ro.outputs:
                if c.index in finished:
                    continue
                st = states.get(c.index)
                if st is None:  # once per choice (not setdefault: it would build a parser per chunk)
                    st = states[c.index] = _ChoiceStream(run)
                start_chars, start_tok = sent_chars.get(c.index, 0), sent_tokens.get(c.index, 0)
                piece = c.text[start_chars:] if len(c.text) > start_chars else ""
                new_ids = c.token_ids[start_tok:]
                logprobs = None
                if req.logprobs and new_ids:
                    logprobs = ChoiceLogprobs(content=_token_logprobs(eng, new_ids, (c.logprobs or [])[start_tok:],
                                                                      top_n, req.return_tokens_as_token_ids))
                sent_chars[c.index] = start_chars + len(piece)
                sent_tokens[c.index] = len(c.token_ids)
                delta = st.delta(piece, c.finished, bool(new_ids))
                if not (delta is not None or c.finished or logprobs is not None):
                    continue
                finish = c.finish_reason
                if c.finished:
                    finished.add(c.index)
                    if st.saw_calls and finish == "stop" and run.tools.mode != "named":
                        finish = "tool_calls"
                choice = ChatChunkChoice(index=c.index, delta=delta or DeltaMessage(), logprobs=logprobs,
                                         finish_reason=finish if c.finished else None,
                                         stop_reason=c.stop_reason)
                frame = chunk([choice], usage() if req.continuous_usage else None)
                if len(finished) < req.num_samples:
                    yield frame
                else:  # nothing follows but the end of gen.outputs(), without waiting
                    tail.append(frame)
        if req.include_usage:
            tail.append(chunk([], usage()))
        yield b"".join(tail) + SSE_DONE
    except APIError as e:
        yield b"".join(tail) + sse_error(e)
    except Exception as e:  # an engine failure mid-stream: tell the client, then end the stream
        log.exception("stream %s failed", gen.base_id)
        yield b"".join(tail) + sse_error(from_engine_error(e) or internal(e))


def prompt_logprobs_json(eng: EngineClient, ro) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first None) {token_id: {logprob, decoded_token}}."""
    if ro.prompt_logprobs is None:
        return None
    out = []
    for d in ro.prompt_logprobs:
        out.append(None if d is None else {str(k): {"logprob": clamp_logprob(v), "decoded_token": eng.token_str(k)}
                                           for k, v in d.items()})
    return out
