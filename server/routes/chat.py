"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template; streaming deltas.

`max_completion_tokens` wins over the deprecated `max_tokens`; with neither, generation may run to
the context limit. `logprobs: true` returns each token's logprob, `top_logprobs: N` the N most
likely alternatives too (N <= 20).
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from linrnn_serve.sampling_params import SamplingParams
from linrnn_server.engine_client import EngineClient
from linrnn_server.errors import APIError, bad_request, from_engine_error, internal
from linrnn_server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs, DeltaMessage,
                                    TokenLogprob, TopLogprob, UsageInfo)
from linrnn_server.rendering import SSE_DONE, SSE_HEADERS, render_chat_prompt, sse_error, sse_frame
from linrnn_server.serving import (Generation, check_model, check_prompt, clamp_logprob, new_id, parse_body,
                                   sampling_params, state_of, until_disconnect, usage_of)

log = logging.getLogger(__name__)
router = APIRouter()


def _token_logprobs(eng: EngineClient, token_ids: list[int], entries: list[dict[int, float]],
                    top_n: int) -> list[TokenLogprob]:
    out = []
    for tid, d in zip(token_ids, entries):
        d = d or {}
        top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        alts = [TopLogprob(token=eng.token_str(k), logprob=clamp_logprob(v), bytes=list(eng.token_bytes(k)))
                for k, v in top]
        out.append(TokenLogprob(token=eng.token_str(tid), logprob=clamp_logprob(d.get(tid)),
                                bytes=list(eng.token_bytes(tid)), top_logprobs=alts))
    return out


def _params(req: ChatCompletionRequest, eng: EngineClient) -> SamplingParams:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs", "invalid_value")
        if not 0 <= req.top_logprobs <= eng.max_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {eng.max_logprobs}], got {req.top_logprobs}",
                              "top_logprobs", "invalid_value")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_request(f"max_completion_tokens must be a positive integer, got {req.max_completion_tokens}",
                          "max_completion_tokens", "invalid_value")
    return sampling_params(req, req.max_new_tokens, logprobs, engine=eng)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request):
    state = state_of(request)
    eng = state.engine
    req = await parse_body(request, ChatCompletionRequest)
    req.check_neutral()
    model = check_model(state, req.model)
    params = _params(req, eng)
    text = render_chat_prompt(eng.tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
                              req.chat_template_kwargs)
    ids = eng.encode(text, add_special_tokens=False)
    check_prompt(eng, ids, req.max_new_tokens, params, "messages")

    gen = Generation(state, new_id("chatcmpl"), [ids], params)
    await until_disconnect(request, gen.start())
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream(gen, req, model, created, eng), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    (ro,) = await until_disconnect(request, gen.final_outputs())
    top_n = req.top_logprobs or 0
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=ChoiceLogprobs(content=_token_logprobs(eng, c.token_ids, c.logprobs or [], top_n))
                          if req.logprobs else None,
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in ro.outputs]
    p, g = usage_of([ro])
    resp = ChatCompletionResponse(id=gen.base_id, created=created, model=model, choices=choices,
                                  usage=UsageInfo(prompt_tokens=p, completion_tokens=g, total_tokens=p + g))
    return JSONResponse(resp.model_dump())


async def _stream(gen: Generation, req: ChatCompletionRequest, model: str, created: int,
                  eng: EngineClient) -> AsyncIterator[bytes]:
    top_n = req.top_logprobs or 0
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    last = None

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse_frame(ChatCompletionChunk(id=gen.base_id, created=created, model=model, choices=choices,
                                             usage=usage))

    def usage() -> UsageInfo:
        p, g = usage_of([last]) if last is not None else (0, 0)
        return UsageInfo(prompt_tokens=p, completion_tokens=g, total_tokens=p + g)

    try:
        for i in range(req.num_samples):  # the role first, as OpenAI does
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for _, ro in gen.outputs():
            last = ro
            for c in ro.outputs:
                if c.index in finished:
                    continue
                start_chars, start_tok = sent_chars.get(c.index, 0), sent_tokens.get(c.index, 0)
                delta = c.text[start_chars:] if len(c.text) > start_chars else ""
                new_ids = c.token_ids[start_tok:]
                logprobs = None
                if req.logprobs and new_ids:
                    logprobs = ChoiceLogprobs(content=_token_logprobs(eng, new_ids, (c.logprobs or [])[start_tok:],
                                                                      top_n))
                if not (delta or c.finished or logprobs is not None):
                    continue
                sent_chars[c.index] = start_chars + len(delta)
                sent_tokens[c.index] = len(c.token_ids)
                if c.finished:
                    finished.add(c.index)
                choice = ChatChunkChoice(index=c.index, delta=DeltaMessage(content=delta if delta else None),
                                         logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                yield chunk([choice], usage() if req.continuous_usage else None)
        if req.include_usage:
            yield chunk([], usage())
        yield SSE_DONE
    except APIError as e:
        yield sse_error(e)
    except Exception as e:  # an engine failure mid-stream: tell the client, then end the stream
        log.exception("stream %s failed", gen.base_id)
        yield sse_error(from_engine_error(e) or internal(e))
