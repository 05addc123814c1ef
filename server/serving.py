"""What the generation routes share: request parsing, model-name and sampling-parameter checks, and
`Generation`, which runs one HTTP request's engine requests (one per prompt), merges their
streams, and aborts everything when the client goes away."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar

import anyio
from pydantic import ValidationError
from starlette.requests import Request

from linrnn_serve.engine.outputs import RequestOutput
from linrnn_serve.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams
from linrnn_server.engine_client import EngineClient
from linrnn_server.errors import (APIError, bad_request, from_engine_error, from_validation_error, internal,
                                  model_not_found)
from linrnn_server.guard import shutting_down
from linrnn_server.metrics import ServerMetrics
from linrnn_server.protocol import RequestModel

M = TypeVar("M", bound=RequestModel)
log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready; its requests were aborted."""


DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # request bodies above this get 413 (--max-request-bytes)
ABORT_RESERVE_S = 1.5  # of a drain timeout (at most a third of it), kept for aborting what is left and exiting


@dataclass
class ServerState:
    engine: EngineClient
    metrics: ServerMetrics
    api_key: str | None = None
    active: set[str] = field(default_factory=set)  # engine request ids in flight
    started: float = field(default_factory=time.time)
    log_requests: bool = False  # one INFO line per request (--disable-log-requests turns it off)
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    draining: bool = False  # shutting down: new requests get 503 (guard.py)
    default_max_tokens: int | None = None  # --default-max-tokens: cap for requests that set no limit

    @property
    def model_names(self) -> list[str]:
        return self.engine.served_model_names

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown, first part: take no new requests, let those in flight finish until
        ABORT_RESERVE_S (at most a third of `timeout`) before `timeout`, then abort the rest: each
        stream then ends with a final chunk (finish_reason "abort") and [DONE], each non-streamed
        request with its partial text. Returns once every request has ended (or `timeout` passed)."""
        self.draining = True
        start = time.monotonic()
        end = start + timeout
        abort_at = end - min(ABORT_RESERVE_S, timeout / 3)
        if self.active:
            log.info("draining: %d request(s) in flight, up to %.1f s", len(self.active), abort_at - start)
        while self.active and time.monotonic() < abort_at:
            await asyncio.sleep(0.05)
        aborted: set[str] = set()
        while self.active and time.monotonic() < end:
            for rid in self.active - aborted:  # one that started late is aborted on the next round
                aborted.add(rid)
                await self.engine.abort(rid)
            await asyncio.sleep(0.02)
        if aborted:
            log.info("drain timeout: aborted %d request(s)", len(aborted))
        if self.active:
            log.warning("%d request(s) still open after the %.1f s shutdown timeout", len(self.active), timeout)


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


PARSE_IN_THREAD_BYTES = 1 << 20  # bodies above this are decoded in a worker thread


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`. Content-Type is not required (curl -d sends a form type). Unknown
    top-level fields of the generation requests are logged and ignored. Its size is bounded by the
    RequestGuard (413). A large body is decoded by json.loads in a worker thread and validated from
    Python objects: pydantic's JSON parser holds the GIL several times longer than json.loads, and
    the event loop (/health, streams) waits for the GIL."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty: send a JSON object.", None, "invalid_json")
    try:
        if len(raw) > PARSE_IN_THREAD_BYTES:
            try:
                obj = await anyio.to_thread.run_sync(json.loads, raw)
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                raise bad_request(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
            body = model.model_validate(obj)
        else:
            body = model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e, model.TYPE_HINTS) from None
    body.warn_unknown(log)
    return body


def check_model(state: ServerState, name: str | None) -> str:
    """The served name a request addresses (the first served name when it names none)."""
    if name is None or name == "":
        return state.model_names[0]
    if name not in state.model_names:
        raise model_not_found(name, state.model_names)
    return name


def sampling_params(req, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, engine: EngineClient | None = None) -> SamplingParams:
    """SamplingParams from the fields /v1/completions and /v1/chat/completions share. Fields the request
    leaves unset take the engine's generation-config defaults, then the OpenAI ones. The engine checks
    them (engine/validation.py; its typed errors become 400s in Generation.start)."""
    defaults = engine.default_sampling_params if engine is not None else {}

    def val(v, default, name=None):
        if v is not None:
            return v
        return defaults.get(name, default) if name else default

    if max_tokens is None and "max_tokens" in defaults:
        max_tokens = defaults["max_tokens"]

    p = SamplingParams(
        n=req.num_samples, temperature=val(req.temperature, 1.0, "temperature"), top_p=val(req.top_p, 1.0, "top_p"),
        top_k=val(req.top_k, 0, "top_k"), min_p=val(req.min_p, 0.0, "min_p"), seed=req.seed,
        presence_penalty=val(req.presence_penalty, 0.0), frequency_penalty=val(req.frequency_penalty, 0.0),
        repetition_penalty=val(req.repetition_penalty, 1.0, "repetition_penalty"),
        max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_list,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens)
    p.structured_outputs = structured_outputs_of(req)
    p.allowed_token_ids = list(req.allowed_token_ids) if req.allowed_token_ids is not None else None
    p.bad_words = list(req.bad_words or [])
    p.truncate_prompt_tokens = req.truncate_prompt_tokens
    p.logit_bias = logit_bias_of(req.logit_bias)
    if req.prompt_logprobs is not None and p.prompt_logprobs is None:
        p.prompt_logprobs = req.prompt_logprobs
    return p


def logit_bias_of(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token-id strings -> bias) as SamplingParams wants it; the engine checks the
    ids against the vocabulary and the values' range."""
    if not bias:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings), e.g. {\"50256\": -100}",
                          "logit_bias", "invalid_value") from None


_SO_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The request's output constraint: response_format, structured_outputs or guided_* (at most one)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format", "invalid_value")
            found.append(("response_format", StructuredOutputsParams(json=schema if schema is not True else {})))
        elif kind == "structural_tag":
            raise bad_request("response_format type 'structural_tag' is not supported (use json_schema, json_object, "
                              "or structured_outputs regex / choice / grammar)", "response_format",
                              "unsupported_parameter")
        elif kind != "text":
            raise bad_request(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                              "response_format", "invalid_value")
    if req.structured_outputs:
        keys = {k for k, v in req.structured_outputs.items() if v not in (None, False)}
        unknown = keys - _SO_KEYS - {"disable_any_whitespace", "disable_fallback", "whitespace_pattern",
                                     "disable_additional_properties"}
        if unknown:
            raise bad_request(f"structured_outputs keys {sorted(unknown)} are not supported (json, regex, choice, "
                              f"grammar, json_object)", "structured_outputs", "unsupported_parameter")
        so = {k: req.structured_outputs[k] for k in keys & _SO_KEYS}
        found.append(("structured_outputs", StructuredOutputsParams(**so)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        v = getattr(req, name, None)
        if v is not None:
            if name == "guided_json" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise bad_request(f"guided_json is not valid JSON: {e}", name, "invalid_value") from None
            found.append((name, StructuredOutputsParams(**{key: v})))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one output constraint may be given, got {[n for n, _ in found]}", found[1][0],
                          "invalid_value")
    name, so = found[0]
    try:
        so.kind()
    except SamplingParamError as e:
        raise bad_request(str(e), name, "invalid_value") from None
    return so


def apply_default_max_tokens(state: ServerState, params: SamplingParams, prompt_len: int) -> None:
    """The policy for a request that sets no max_tokens (README "Limits"): it may generate up to the
    context limit, max_model_len - prompt tokens (vLLM's rule), capped at --default-max-tokens when
    the server sets one."""
    if params.max_tokens is None and state.default_max_tokens:
        params.max_tokens = max(1, min(state.default_max_tokens, state.engine.max_model_len - prompt_len))


async def until_disconnect(request: Request, coro):
    """Await `coro`, cancelling it if the client disconnects first (then raise ClientDisconnected).
    Streaming responses get the same from EventStreamResponse once they have started."""
    gone, result = await cancel_on_disconnect(request.receive, coro)
    if gone:
        raise ClientDisconnected()
    return result


async def cancel_on_disconnect(receive, coro) -> tuple[bool, Any]:
    """Await `coro`, cancelling it if the client disconnects first: (True, None) then, else (False, its result).
    `coro` runs in this task (a task of its own would start a loop turn later: the request's hand-over to the
    engine and its first token each waited for one more turn of a loop busy with every other stream); a watcher
    task, never awaited, cancels this one on a disconnect (plain asyncio: an anyio task group and cancel scope
    cost each of a c = 64 wave's 64 streams ~10 us more, at its start and at its end)."""
    route = asyncio.current_task()
    gone = False

    async def watch():
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        route.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return False, await coro
    except asyncio.CancelledError:
        if gone:  # our own cancellation: the client left
            route.uncancel()
            return True, None
        raise
    finally:
        watcher.cancel()  # not awaited: nothing depends on it, and awaiting costs a loop turn


async def _first_or_error(it: AsyncIterator[RequestOutput]) -> RequestOutput | Exception:
    """The first output, or the error (as `asyncio.gather(..., return_exceptions=True)` would give it)."""
    try:
        return await anext(it)
    except Exception as e:  # noqa: BLE001 - mapped by Generation.start
        return e


class Generation:
    """One HTTP request: one engine request per prompt, each with `params.n` samples.

    `start()` submits them all and waits for each one's first output, so that refusals (the engine's
    validation, queue full) become HTTP errors before a stream's 200 header is sent. `outputs()` then
    yields `(prompt_index, cumulative RequestOutput)` as they arrive from any prompt.
    """

    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                 param_names: dict[str, str] | None = None):
        self.state, self.base_id, self.prompts, self.params = state, base_id, prompts, params
        # the engine names SamplingParams fields and "prompt"; this route's request may call them otherwise
        self.param_names = param_names or {}
        self.ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        self._iters: list[AsyncIterator[RequestOutput]] = []
        self._first: list[RequestOutput] = []

    async def start(self) -> None:
        if self.state.draining:
            raise shutting_down()
        eng = self.state.engine
        if self.state.log_requests:
            log.info("request %s: %d prompt(s) of %s tokens, params %s", self.base_id, len(self.prompts),
                     ",".join(str(len(p)) for p in self.prompts), self.params)
        self._iters = [eng.generate(ids, self.params, rid) for ids, rid in zip(self.prompts, self.ids)]
        self.state.active.update(self.ids)
        try:
            if len(self._iters) == 1:  # awaited in this task: a gather's child task costs a loop iteration
                results = [await _first_or_error(self._iters[0])]
            else:
                results = await asyncio.gather(*(anext(it) for it in self._iters), return_exceptions=True)
        except BaseException:  # cancelled: the client went away, or shutdown
            await self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            for e in errors:
                if isinstance(e, StopAsyncIteration):
                    continue
                mapped = from_engine_error(e, self.param_names)
                if mapped is not None:
                    raise mapped
            e = next((e for e in errors if not isinstance(e, StopAsyncIteration)), None)
            if e is None:
                raise internal(RuntimeError("the engine ended a request without output"))
            if isinstance(e, (asyncio.CancelledError, APIError)):
                raise e
            raise internal(e) from e
        self._first = list(results)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The primed first outputs, then every later one, interleaved across prompts."""
        try:
            for i, out in enumerate(self._first):
                yield i, out
            pending = [i for i, out in enumerate(self._first) if not out.finished]
            if len(pending) == 1:  # the common case: no merging machinery
                i = pending[0]
                async for out in self._iters[i]:
                    yield i, out
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int) -> None:
                try:
                    async for out in self._iters[i]:
                        queue.put_nowait((i, out, None))
                except Exception as e:  # noqa: BLE001 - handed to the consumer
                    queue.put_nowait((i, None, e))
                    return
                queue.put_nowait((i, None, None))

            tasks = [asyncio.ensure_future(pump(i)) for i in pending]
            try:
                remaining = len(tasks)
                while remaining:
                    i, out, err = await queue.get()
                    if err is not None:
                        raise err
                    if out is None:
                        remaining -= 1
                        continue
                    yield i, out
            finally:
                for t in tasks:
                    t.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self.close()

    async def final_outputs(self) -> list[RequestOutput]:
        last = list(self._first)
        try:
            async for i, out in self.outputs():
                last[i] = out
        except APIError:
            raise
        except Exception as e:  # the engine failed mid-request: a 500 with an error object
            log.exception("request %s failed", self.base_id)
            raise from_engine_error(e) or internal(e) from e
        return last

    async def close(self) -> None:
        """Abort whatever has not finished (each stream's cleanup aborts its request)."""
        with anyio.CancelScope(shield=True):
            for it in self._iters:
                try:
                    await it.aclose()
                except BaseException:  # noqa: BLE001 - best effort
                    pass
        self.state.active.difference_update(self.ids)


LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def clamp_logprob(v: float | None) -> float:
    return LOGPROB_FLOOR if v is None or v != v or v < LOGPROB_FLOOR else float(v)


def usage_info(outputs: list[RequestOutput]):
    """OpenAI's usage block; `prompt_tokens_details.cached_tokens` (as vLLM: only when the prefix
    cache served part of a prompt) counts the prompt tokens that were not computed again."""
    from linrnn_server.protocol import PromptTokensDetails, UsageInfo

    p, g = usage_of(outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) for o in outputs)
    return UsageInfo(prompt_tokens=p, completion_tokens=g, total_tokens=p + g,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None)


def usage_of(outputs: list[RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens): each prompt once, every generated token of every sample."""
    return (sum(len(o.prompt_token_ids) for o in outputs),
            sum(len(c.token_ids) for o in outputs for c in o.outputs))


async def log_stats_forever(engine: EngineClient, interval: float) -> None:
    """vLLM's periodic statistics line (off with --disable-log-stats): throughput since the last line,
    running / waiting requests, cache usage."""
    last_t, last_p, last_g = time.monotonic(), None, None
    while True:
        await asyncio.sleep(interval)
        s = engine.stats() or {}
        now = time.monotonic()
        p, g = s.get("prompt_tokens_total", 0), s.get("generation_tokens_total", 0)
        dt = max(now - last_t, 1e-9)
        pt = (p - last_p) / dt if last_p is not None else p / dt
        gt = (g - last_g) / dt if last_g is not None else g / dt
        log.info("engine: avg prompt throughput %.1f tokens/s, avg generation throughput %.1f tokens/s, running %d "
                 "reqs, waiting %d reqs, KV cache usage %.1f%%, state cache usage %.1f%%", pt, gt,
                 s.get("num_requests_running", 0), s.get("num_requests_waiting", 0),
                 100 * s.get("kv_cache_usage", 0.0), 100 * s.get("state_cache_usage", 0.0))
        last_t, last_p, last_g = now, p, g
