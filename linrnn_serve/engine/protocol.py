"""Messages between the engine core process and its clients (msgspec / msgpack over ZeroMQ).

Client -> core (one PUSH socket, one message each):
    AddRequest    a request: prompt ids, SamplingParams (every field: constraints, bad_words, seeds,
                  stop, n, logprobs, ...), arrival time; the core validates it (engine/validation.py)
    AbortRequest  stop a request (its final delta comes back with finish_reason "abort")
    Shutdown      abort everything and exit

Core -> client (one PUSH socket, ONE message per engine step):
    StepOutputs   the per-request deltas of that step (new token ids and logprobs per sample,
                  finish reason, prefix-cache hits), refusals of adds (`error`: a typed error of
                  engine/errors.py, rebuilt as the same type by the client), and now and then a
                  stats snapshot. A running single-sample request's one new token without logprobs
                  (nearly every row of a decode step) goes in two columns instead (request ids,
                  token ids): no per-request object on either side

The core sends token ids only; the client detokenizes. Stop strings are the exception: deciding
where a sequence ends needs text, so the core detokenizes requests that have stop strings and
reports, for a sequence it stopped on one, `text_len`, the length of the cut text (the client's
detokenizer produces the same text and cuts it there).

Plain data only: no torch, importable by the HTTP server.
"""
from __future__ import annotations

import msgspec

from linrnn_serve.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, array_like=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None


class AbortRequest(msgspec.Struct, array_like=True, tag="abort"):
    request_id: str


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


ClientMessage = AddRequest | AbortRequest | Shutdown


class ErrorInfo(msgspec.Struct, array_like=True):
    """An exception of the core, rebuilt as the same type on the client (engine/errors.py)."""

    kind: str  # the exception class name
    message: str
    param: str | None = None
    code: str | None = None  # RequestError.code


class SeqDelta(msgspec.Struct, array_like=True):
    index: int  # which of the request's n samples
    token_ids: list[int]  # tokens new since the last delta
    logprobs: list[dict[int, float]] | None = None  # one entry per new token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_len: int | None = None  # stopped by a stop string: keep this many characters of the text


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # entries new since the last delta
    first_token_time: float | None = None
    finished_time: float | None = None
    error: ErrorInfo | None = None  # the add was refused (queue full, prompt too long, bad params)
    prompt_token_ids: list[int] | None = None  # first delta only, when the core changed them (truncation)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (usage.prompt_tokens_details)


class StepOutputs(msgspec.Struct, array_like=True):
    deltas: list[RequestDelta]
    stats: dict | None = None  # LLMEngine.stats(), at most every STATS_INTERVAL_S
    dead: ErrorInfo | None = None  # the core's loop failed; the process exits after this message
    # a decode step's common case as two columns instead of a RequestDelta each: one new token for each of
    # these requests (one sample, no logprobs, still running, its first delta already sent)
    token_request_ids: list[str] = []
    token_ids: list[int] = []

    def new_tokens(self):
        """(request id, number of new tokens: 0 for a delta without any) per request of this message (traces)."""
        for d in self.deltas:
            yield d.request_id, sum(len(s.token_ids) for s in d.seqs)
        for rid in self.token_request_ids:
            yield rid, 1


STATS_INTERVAL_S = 0.25
STATS_FRESH_S = 0.02  # after the running / waiting counts change, a snapshot within this

encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
outputs_decoder = msgspec.msgpack.Decoder(StepOutputs)
