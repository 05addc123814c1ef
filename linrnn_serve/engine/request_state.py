"""A request's cumulative output on the consumer's side, built from the engine core's per-step deltas.

    st = RequestState(loop, request_id, prompt_text, prompt_ids, params, arrival_time, tokenizer)
    deliver(states, step_outputs)    # engine side (a receiver or engine thread): apply, wake the loops
    async for out in outputs(st):    # consumer side: the newest cumulative RequestOutput at each wake-up
        ...

Both engine clients use it: AsyncMPClient (the core in its own process, deltas over ZeroMQ) and the
in-process AsyncLLMEngine (the core in a thread). The engine side appends each delta's tokens and
detokenizes them incrementally (O(new tokens) per step); a cumulative output is built only when the
consumer reads, and a slow consumer skips the intermediate ones.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator

from linrnn_serve.engine.errors import rebuild
from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput
from linrnn_serve.engine.protocol import ErrorInfo, RequestDelta, StepOutputs
from linrnn_serve.engine.tokenizer import Tokenizer
from linrnn_serve.sampling_params import SamplingParams


def rebuild_error(info: ErrorInfo) -> BaseException:
    """The core's exception as the same type here (engine/errors.py)."""
    return rebuild(info.kind, info.message, info.param, info.code)


def visible_text(text: str, params: SamplingParams, finished: bool) -> str:
    """While running, hold back a possible stop-string prefix (vLLM's rule)."""
    if finished or not params.stop or params.include_stop_str_in_output:
        return text
    hold = max(len(s) for s in params.stop) - 1
    return text[: max(0, len(text) - hold)]


class SeqState:
    __slots__ = ("token_ids", "logprobs", "detok", "text", "finish_reason", "stop_reason")

    def __init__(self, detok, logprobs: bool):
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if logprobs else None
        self.detok, self.text = detok, ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class RequestState:
    """One request's cumulative output, built from the core's deltas (updated on the receiver thread,
    read on the consumer's event loop; `lock` guards the pair)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, arrival_time: float, tokenizer: Tokenizer | None):
        self.loop, self.request_id, self.prompt, self.prompt_ids = loop, request_id, prompt, prompt_ids
        self.params, self.arrival_time, self.tokenizer = params, arrival_time, tokenizer
        self.seqs: list[SeqState] | None = None  # made at the first delta (the core may truncate the prompt)
        self.num_cached_tokens = 0
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.finished = False
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.dirty = False
        self.lock = threading.Lock()

    def apply(self, d: RequestDelta) -> None:
        with self.lock:
            if self.finished:
                return
            if d.error is not None:
                self.error = rebuild_error(d.error)
            if d.prompt_token_ids is not None:
                self.prompt_ids = d.prompt_token_ids
            if self.seqs is None:
                self._make_seqs()
            self.num_cached_tokens = d.num_cached_tokens
            for sd in d.seqs:
                s = self.seqs[sd.index]
                s.token_ids += sd.token_ids
                if s.logprobs is not None and sd.logprobs is not None:
                    s.logprobs += sd.logprobs
                if s.detok is not None:
                    stop_on_token = sd.finish_reason == "stop" and sd.stop_reason is not None and \
                        not isinstance(sd.stop_reason, str)
                    eos = sd.finish_reason == "stop" and sd.stop_reason is None and sd.token_ids
                    toks = sd.token_ids
                    if (stop_on_token or eos) and not self.params.include_stop_str_in_output:
                        toks = toks[:-1]  # the stop token's text is not part of the output (as the scheduler)
                    for t in toks:
                        s.text += s.detok.update(t)
                    if sd.text_len is not None:  # stopped by a stop string: cut where the core cut
                        s.text = s.text[:sd.text_len]
                    elif sd.finish_reason is not None:  # a held-back partial character shows as U+FFFD
                        flush = getattr(s.detok, "flush", None)
                        if flush is not None and s.token_ids:
                            s.text += flush()
                s.finish_reason, s.stop_reason = sd.finish_reason, sd.stop_reason
            if d.prompt_logprobs and self.prompt_logprobs is not None:
                self.prompt_logprobs += d.prompt_logprobs
            if d.first_token_time is not None:
                self.first_token_time = d.first_token_time
            if d.finished:
                self.finished = True
                self.finished_time = d.finished_time or time.monotonic()
            self.dirty = True

    def _make_seqs(self) -> None:
        tok, p = self.tokenizer, self.params
        self.seqs = [SeqState(tok.detokenizer(self.prompt_ids, p) if tok else None, p.logprobs is not None)
                     for _ in range(p.n)]

    def apply_token(self, t: int) -> None:
        """One new token of the single sample, still running (StepOutputs' token columns)."""
        with self.lock:
            if self.finished:
                return
            if self.seqs is None:
                self._make_seqs()
            s = self.seqs[0]
            s.token_ids.append(t)
            if s.detok is not None:
                s.text += s.detok.update(t)
            self.dirty = True

    def fail(self, e: BaseException) -> None:
        with self.lock:
            if not self.finished and self.error is None:
                self.error = e
                self.dirty = True

    def output(self) -> RequestOutput | BaseException:
        with self.lock:
            self.dirty = False
            if self.error is not None:
                return self.error
            outs = [CompletionOutput(i, visible_text(s.text, self.params, s.finish_reason is not None),
                                     list(s.token_ids), list(s.logprobs) if s.logprobs is not None else None,
                                     s.finish_reason, s.stop_reason) for i, s in enumerate(self.seqs or ())]
            return RequestOutput(
                self.request_id, self.prompt, self.prompt_ids, outs, self.finished,
                prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                metrics={"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                         "finished_time": self.finished_time}, num_cached_tokens=self.num_cached_tokens)


def wake(states: list[RequestState]) -> None:  # on the consumers' event loop
    for st in states:
        st.event.set()


def deliver(states: dict[str, RequestState], out: StepOutputs) -> None:
    """Apply one step's outputs (engine side: its deltas, then its token columns) and wake each consumer loop
    once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[RequestState]] = {}
    for d in out.deltas:
        st = states.get(d.request_id)
        if st is None:  # the consumer left (its abort is on the way)
            continue
        st.apply(d)
        by_loop.setdefault(st.loop, []).append(st)
    if out.token_ids:
        for rid, t in zip(out.token_request_ids, out.token_ids):
            st = states.get(rid)
            if st is None:
                continue
            st.apply_token(t)
            woken = by_loop.get(st.loop)
            if woken is None:
                woken = by_loop[st.loop] = []
            woken.append(st)
    wake_loops(by_loop)


def fail_all(states: list[RequestState], e: BaseException) -> None:
    """End every stream with `e` (the engine died or was stopped)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[RequestState]] = {}
    for st in states:
        st.fail(e)
        by_loop.setdefault(st.loop, []).append(st)
    wake_loops(by_loop)


def wake_loops(by_loop: dict[asyncio.AbstractEventLoop, list[RequestState]]) -> None:
    for loop, sts in by_loop.items():
        try:
            loop.call_soon_threadsafe(wake, sts)
        except RuntimeError:  # the consumer's loop is closed
            pass


async def outputs(st: RequestState) -> AsyncIterator[RequestOutput]:
    """The consumer's side: the newest cumulative output at each wake-up until finished; the request's
    error (a refusal, the engine's death) is raised."""
    while True:
        await st.event.wait()
        st.event.clear()
        if not st.dirty:
            continue
        out = st.output()
        if isinstance(out, BaseException):
            raise out
        yield out
        if out.finished:
            return
