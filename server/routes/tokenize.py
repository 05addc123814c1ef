"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages -> token ids, and back."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from linrnn_server.errors import bad_request
from linrnn_server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from linrnn_server.rendering import render_chat_prompt
from linrnn_server.serving import check_model, parse_body, state_of

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> TokenizeResponse:
    state = state_of(request)
    req = await parse_body(request, TokenizeRequest)
    check_model(state, req.model)
    eng = state.engine
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Send exactly one of 'prompt' or 'messages'.", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("'messages' is empty.", "messages")
        text = await eng.run_blocking(render_chat_prompt, eng.tokenizer, req.messages, req.add_generation_prompt,
                                      req.continue_final_message, req.chat_template_kwargs, tools=req.tools,
                                      chat_template=eng.chat_template)
        ids = await eng.encode_async(text, add_special_tokens=False, param="messages")
    else:
        ids = await eng.encode_async(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [eng.token_str(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=eng.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(request: Request) -> DetokenizeResponse:
    state = state_of(request)
    req = await parse_body(request, DetokenizeRequest)
    check_model(state, req.model)
    eng = state.engine
    bad = next((t for t in req.tokens if not (0 <= t < eng.vocab_size and eng.knows(t))), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is not in the tokenizer's vocabulary.", "tokens", "invalid_value")
    return DetokenizeResponse(prompt=eng.decode(req.tokens))
