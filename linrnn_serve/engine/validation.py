"""Request validation: the one place that decides whether the engine takes a request.

    ids = validate_request(prompt_ids, params, limits, tokenizer, structured)

LLMEngine.add_request calls it (in the engine-core process, that is what answers the API server's
requests), AsyncLLMEngine.generate calls it before queueing. It raises the typed errors of
engine/errors.py, which the server maps to OpenAI errors (400 with `param` and `code`); nothing else
checks a request's parameters. Engine-state refusals (queue full, duplicate id) stay in add_request.

Besides checking, it applies the per-request extras that need the tokenizer or the grammar compiler:
truncate_prompt_tokens (keep the last N), bad_words -> token sequences, structured output /
allowed_token_ids compiled (cached). Returns the prompt ids the engine runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from linrnn_serve.engine.errors import PromptTooLongError, RequestError
from linrnn_serve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (LLMEngine.limits)."""

    vocab_size: int  # the model's (token-id prompts may use ids the tokenizer does not know)
    max_model_len: int
    max_num_seqs: int  # a request's n samples run at once
    kv_capacity_tokens: int | None = None  # the KV cache's tokens (None: not bounded separately)
    max_logprobs: int | None = None  # --max-logprobs (None: SamplingParams.MAX_LOGPROBS)


def validate_request(prompt_ids: list[int], params: SamplingParams, limits: RequestLimits, tokenizer=None,
                     structured=None) -> list[int]:
    """Check a request and apply its extras; the prompt ids to run. Raises RequestError (and its kinds
    SamplingParamError, StructuredOutputError, PromptTooLongError) naming the parameter at fault."""
    params.validate(limits.max_logprobs)
    if params.n > limits.max_num_seqs:
        raise RequestError(f"n={params.n} exceeds this server's --max-num-seqs ({limits.max_num_seqs})", "n")
    ids = list(prompt_ids)
    if not ids:
        raise RequestError("The prompt is empty (it has no tokens).", "prompt")
    V = limits.vocab_size
    # C-speed checks first (types, then the range): a per-token Python loop cost the core ~0.5 ms per 3k-token
    # request on the H200 host; the loop only names the first bad id
    if not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= V:
        t = next(t for t in ids if type(t) is not int or not 0 <= t < V)
        raise RequestError(f"Token id {t!r} in the prompt is out of range (the vocabulary has {V} tokens).",
                           "prompt")
    bias = params.logit_bias
    if bias and any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V for t in bias):
        raise RequestError(f"logit_bias token ids must be in [0, {V}), got {sorted(map(repr, bias))[:5]}",
                           "logit_bias")
    if params.truncate_prompt_tokens is not None:
        ids = ids[-params.truncate_prompt_tokens:]
    _check_length(len(ids), params, limits)
    if params.bad_words and params.bad_words_token_ids is None:
        if tokenizer is None:
            raise RequestError("bad_words needs a tokenizer (this model has none)", "bad_words")
        seqs: list[list[int]] = []
        for w in params.bad_words:  # as vLLM: the word alone and after a space
            for v in (w, " " + w.lstrip()):
                t = tokenizer.encode(v, add_special_tokens=False)
                if t and t not in seqs:
                    seqs.append(t)
        params.bad_words_token_ids = seqs
    if structured is not None and structured.needs(params):
        structured.check(params)  # compiles (cached): StructuredOutputError
    return ids


def _check_length(n: int, params: SamplingParams, limits: RequestLimits) -> None:
    limit = limits.max_model_len
    mt = params.max_tokens
    want = n + (mt if mt is not None else 1)
    if want > limit:
        detail = f"{n} in the prompt, {mt if mt else 'at least 1'} in the completion"
        raise PromptTooLongError(
            f"This model's maximum context length is {limit} tokens. However, you requested {want} tokens "
            f"({detail}). Please reduce the length of the prompt or completion.",
            "prompt" if n >= limit or not mt else "max_tokens")
    cap = limits.kv_capacity_tokens
    if cap is not None and want > cap:
        raise PromptTooLongError(f"The prompt ({n} tokens) plus max_tokens needs {want} tokens of KV cache but the "
                                 f"cache holds {cap}. Please reduce the length of the prompt or completion.",
                                 "prompt" if n >= cap or not mt else "max_tokens")
