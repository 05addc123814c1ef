"""POST /v1/completions: prompt as a string, strings, token ids or lists of token ids; streaming or not.

Choices are numbered `prompt_index * n + sample_index` (as OpenAI and vLLM do for list prompts).
`echo` prepends the prompt (its text, or its ids decoded); with `logprobs` it also returns the prompt
tokens' logprobs, the first being null.
"""
from __future__ import annotations

import asyncio
import codecs
import logging
import time
from typing import AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput
from linrnn_server.engine_client import EngineClient
from linrnn_server.errors import APIError, bad_request, from_engine_error, internal
from linrnn_server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                    UsageInfo)
from linrnn_server.rendering import SSE_DONE, EventStreamResponse, sse_error, sse_frame
from linrnn_server.serving import (Generation, apply_default_max_tokens, check_model, clamp_logprob,
                                   new_id, parse_body, sampling_params, state_of, until_disconnect, usage_info)

log = logging.getLogger(__name__)
router = APIRouter()

async def _prompts(eng: EngineClient, prompt, reserve: int) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and text (None for id prompts: decoded only if echoed) of each prompt. Text is
    tokenized off the event loop; one that cannot fit the context is refused before tokenizing."""
    if isinstance(prompt, str):
        return [await eng.encode_async(prompt, reserve=reserve)], [prompt]
    if not prompt:
        return [[]], [None]
    if isinstance(prompt[0], str):
        return list(await asyncio.gather(*(eng.encode_async(p, reserve=reserve) for p in prompt))), list(prompt)
    if isinstance(prompt[0], int):
        return [list(prompt)], [None]
    return [list(p) for p in prompt], [None] * len(prompt)


class _LogprobBuilder:
    """Appends tokens to a CompletionLogprobs, keeping text_offset running across stream chunks.

    A token's text_offset is where its text starts in the choice's text: the length of the text the
    tokens before it decode to (an incomplete UTF-8 character counts once it is complete), so offsets
    never pass the text even when single tokens hold partial characters (shown as U+FFFD in `tokens`)."""

    def __init__(self, eng: EngineClient, offset: int = 0, skip_special_tokens: bool = True,
                 as_ids: bool | None = False):
        self.eng, self.offset, self.skip = eng, offset, skip_special_tokens
        self.name = (lambda t: f"token_id:{t}") if as_ids else eng.token_str  # return_tokens_as_token_ids
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = False  # the decoder holds the first bytes of a character

    def restart(self, offset: int) -> None:
        self.offset = offset
        self.utf8.reset()
        self.partial = False

    def _advance(self, tid: int) -> None:
        if self.skip and self.eng.is_special(tid):
            return
        b = self.eng.token_bytes(tid)
        if not self.partial and b.isascii():  # most tokens: one character per byte, no decoder call
            self.offset += len(b)
            return
        self.offset += len(self.utf8.decode(b))
        self.partial = bool(self.utf8.getstate()[0])

    def add(self, into: CompletionLogprobs, token_ids: list[int], entries: list[dict[int, float] | None],
            first_is_null: bool = False) -> CompletionLogprobs:
        for j, (tid, d) in enumerate(zip(token_ids, entries)):
            into.tokens.append(self.name(tid))
            into.text_offset.append(self.offset)
            self._advance(tid)
            if d is None or (first_is_null and j == 0):
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            into.token_logprobs.append(clamp_logprob(d.get(tid)))
            # the sampled token and the top-N alternatives (so up to N+1 entries, as OpenAI documents)
            into.top_logprobs.append({self.name(k): clamp_logprob(v)
                                      for k, v in sorted(d.items(), key=lambda kv: -kv[1])})
        return into


def _echo_text(eng: EngineClient, text: str | None, ids: list[int]) -> str:
    return text if text is not None else eng.decode(ids, skip_special_tokens=False)


@router.post("/v1/completions")
async def create_completion(request: Request):
    state = state_of(request)
    eng = state.engine
    req = await parse_body(request, CompletionRequest)
    req.check_neutral()
    model = check_model(state, req.model)
    prompts, texts = await _prompts(eng, req.prompt, req.max_tokens or 1)
    echo_logprobs = req.echo and req.logprobs is not None
    # max_tokens=0 with echo scores the prompt (vLLM): one token is generated and dropped
    scoring = req.max_tokens == 0
    if scoring and not req.echo:
        raise bad_request("max_tokens=0 is only allowed with echo=true (prompt scoring)", "max_tokens",
                          "invalid_value")
    max_tokens = 1 if scoring else req.max_tokens
    params = sampling_params(req, max_tokens, req.logprobs, req.logprobs if echo_logprobs else None,
                             engine=eng)
    apply_default_max_tokens(state, params, max(map(len, prompts)))  # max_tokens: null (absent: 16, as OpenAI)

    gen = Generation(state, new_id("cmpl"), prompts, params)
    await until_disconnect(request, gen.start())
    created = int(time.time())
    if req.stream:
        return EventStreamResponse(_stream(gen, req, model, created, texts, eng))
    finals = await until_disconnect(request, gen.final_outputs())
    choices = []
    for pi, ro in enumerate(finals):
        for c in ro.outputs:
            choices.append(_choice(eng, req, pi, ro, c, texts[pi]))
    usage = usage_info(finals)
    if scoring:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    plp = None
    if req.prompt_logprobs is not None:
        from linrnn_server.routes.chat import prompt_logprobs_json

        plp = [x for ro in finals for x in (prompt_logprobs_json(eng, ro) or [])]
    resp = CompletionResponse(id=gen.base_id, created=created, model=model, choices=choices,
                              usage=usage, prompt_logprobs=plp)
    return JSONResponse(resp.model_dump())


def _choice(eng: EngineClient, req: CompletionRequest, pi: int, ro: RequestOutput, c: CompletionOutput,
            prompt_text: str | None) -> CompletionChoice:
    text, logprobs, token_ids, entries = c.text, None, c.token_ids, c.logprobs or []
    if req.max_tokens == 0:  # prompt scoring: the one generated token is not part of the answer
        text, token_ids, entries = "", [], []
    prefix = _echo_text(eng, prompt_text, ro.prompt_token_ids) if req.echo else ""
    if req.logprobs is not None:
        logprobs = CompletionLogprobs()
        b = _LogprobBuilder(eng, skip_special_tokens=req.skip_special_tokens,
                            as_ids=req.return_tokens_as_token_ids)
        if req.echo:
            b.add(logprobs, ro.prompt_token_ids, ro.prompt_logprobs or [None] * len(ro.prompt_token_ids), True)
            b.restart(len(prefix))
        b.add(logprobs, token_ids, entries)
        # tokens past a stop string (cut from the text) start at the text's end
        logprobs.text_offset = [min(o, len(prefix) + len(text)) for o in logprobs.text_offset]
    return CompletionChoice(index=pi * req.num_samples + c.index, text=prefix + text, logprobs=logprobs,
                            finish_reason="length" if req.max_tokens == 0 else c.finish_reason,
                            stop_reason=c.stop_reason)


async def _stream(gen: Generation, req: CompletionRequest, model: str, created: int, texts: list[str | None],
                  eng: EngineClient) -> AsyncIterator[bytes]:
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    builders: dict[int, _LogprobBuilder] = {}
    finished: set[int] = set()
    last: dict[int, RequestOutput] = {}

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return sse_frame(CompletionResponse(id=gen.base_id, created=created, model=model, choices=choices,
                                            usage=usage))

    def usage() -> UsageInfo:
        return usage_info(list(last.values()))

    total = len(gen.prompts) * req.num_samples
    tail: list[bytes] = []  # the last choice's final frame, held to go out with usage and [DONE] in one write
    try:
        async for pi, ro in gen.outputs():
            last[pi] = ro
            for c in ro.outputs:
                idx = pi * req.num_samples + c.index
                if idx in finished:
                    continue
                first = idx not in sent_chars
                start_chars, start_tok = sent_chars.get(idx, 0), sent_tokens.get(idx, 0)
                delta = c.text[start_chars:] if len(c.text) > start_chars else ""
                new_ids = c.token_ids[start_tok:]
                if req.max_tokens == 0:  # prompt scoring: drop the one generated token
                    delta, new_ids = "", []
                prefix = _echo_text(eng, texts[pi], ro.prompt_token_ids) if req.echo and first else ""
                logprobs = None
                if req.logprobs is not None:
                    b = builders.get(idx)
                    if b is None:
                        b = builders[idx] = _LogprobBuilder(eng, skip_special_tokens=req.skip_special_tokens,
                                                            as_ids=req.return_tokens_as_token_ids)
                    logprobs = CompletionLogprobs()
                    if req.echo and first:
                        b.add(logprobs, ro.prompt_token_ids,
                              ro.prompt_logprobs or [None] * len(ro.prompt_token_ids), True)
                        b.restart(len(prefix))
                    b.add(logprobs, new_ids, (c.logprobs or [])[start_tok:])
                # a chunk per engine output with new tokens, even when they add no text yet (a partial UTF-8
                # character, a held-back stop-string prefix, a special token): vLLM does the same, and
                # clients time tokens by chunks (skipping them made bursts of ~24 tokens on a byte-level vocab)
                if not (delta or prefix or c.finished or new_ids):
                    continue
                sent_chars[idx] = start_chars + len(delta)
                sent_tokens[idx] = len(c.token_ids)
                if c.finished:
                    finished.add(idx)
                choice = CompletionChoice(index=idx, text=prefix + delta, logprobs=logprobs,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                frame = chunk([choice], usage() if req.continuous_usage else None)
                if len(finished) < total:
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
