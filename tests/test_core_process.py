"""The engine core in its own process (engine/core.py) behind AsyncMPClient (engine/core_client.py):
same outputs as the offline engine, refusals as typed errors, aborts, shutdown, and a killed core
turning into 503s and an unhealthy /health within a second."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine_fixtures import make_tiny_model_dir
from linrnn_serve.config import EngineConfig
from linrnn_serve.engine.outputs import EngineDeadError, EngineFullError, PromptTooLongError
from linrnn_serve.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams

KW = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, block_size=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def _client(model_dir, **kw):
    from linrnn_serve.engine.core_client import AsyncMPClient

    return AsyncMPClient(EngineConfig(model=model_dir, **{**KW, **kw}))


async def _last(client, prompt, params, rid):
    last = None
    async for out in client.generate(prompt, params, rid):
        last = out
    return last


CASES = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, n=2, logprobs=2),
    SamplingParams(temperature=0, max_tokens=40, stop=["o", "é"]),
    SamplingParams(temperature=0, max_tokens=40, stop=["e"], include_stop_str_in_output=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=10, prompt_logprobs=1, min_tokens=4),
]


def test_matches_offline_engine_and_refuses_with_typed_errors(model_dir):
    from linrnn_serve.llm import LLM

    llm = LLM(model_dir, progress=False, **KW)
    prompts = ["hello world", "héllo wörld, café", "The capital of France is", "你好，世界", "emoji 😀"]
    want = llm.generate(prompts, CASES)
    client = _client(model_dir)
    try:
        assert client.tokenizer is not None and client.max_model_len == 256

        async def main():
            got = await asyncio.gather(*(_last(client, p, c, f"r{i}")
                                         for i, (p, c) in enumerate(zip(prompts, CASES))))
            def close(x, y):  # logprobs: the core may run another CPU thread count (f32 reduction order)
                return x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)

            for g, w in zip(got, want):
                assert g.finished and g.prompt_token_ids == w.prompt_token_ids
                assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
                for x, y in zip(g.prompt_logprobs or [], w.prompt_logprobs or []):
                    assert x == y or close(x, y)
                for a, b in zip(g.outputs, w.outputs):
                    assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                           (b.token_ids, b.text, b.finish_reason, b.stop_reason)
                    assert (a.logprobs is None) == (b.logprobs is None)
                    assert all(close(x, y) for x, y in zip(a.logprobs or [], b.logprobs or []))
            with pytest.raises(PromptTooLongError):
                await _last(client, list(range(1, 300)), SamplingParams(max_tokens=4), "long")
            with pytest.raises(SamplingParamError):
                await _last(client, [1, 2], SamplingParams(temperature=-1), "bad")
            with pytest.raises(ValueError):
                await _last(client, [10**6], SamplingParams(max_tokens=2), "oov")
            # leaving early aborts; an explicit abort ends the stream with finish_reason "abort"
            gen = client.generate([5, 6], SamplingParams(max_tokens=200, ignore_eos=True), "early")
            await gen.__anext__()
            await gen.aclose()
            gen = client.generate([7, 8], SamplingParams(max_tokens=200, ignore_eos=True), "ab")
            first = await gen.__anext__()
            await client.abort("ab")
            last = first
            async for o in gen:
                last = o
            assert last.finished and last.outputs[0].finish_reason == "abort"
            for _ in range(100):  # stats arrive every 0.25 s
                s = client.stats()
                if s.get("num_requests_running") == 0 and s.get("kv_cache_usage") == 0:
                    break
                await asyncio.sleep(0.05)
            assert s["num_requests_running"] == 0 and s["kv_cache_usage"] == 0 and s["state_cache_usage"] == 0
            # graceful shutdown: in-flight requests finish, later ones are refused
            task = asyncio.ensure_future(_last(client, [1], SamplingParams(max_tokens=10, ignore_eos=True), "f"))
            await asyncio.sleep(0.05)
            await client.shutdown(mode="finish", timeout=30)
            assert (await task).outputs[0].finish_reason == "length"
            with pytest.raises(EngineDeadError):
                await _last(client, [1], SamplingParams(max_tokens=2), "late")

        asyncio.run(main())
        assert client.proc.poll() == 0
    finally:
        client.shutdown_sync(timeout=5)


def test_full_queue_refused(model_dir):
    client = _client(model_dir, max_queue_len=1, max_num_seqs=1, max_num_batched_tokens=4)
    try:
        async def main():
            p = SamplingParams(max_tokens=200, ignore_eos=True)
            g1 = client.generate([1, 2, 3, 4, 5, 6, 7, 8], p, "a")
            await g1.__anext__()  # a is running
            g2 = client.generate([1, 2], p, "b")
            t2 = asyncio.ensure_future(g2.__anext__())  # b waits (the only slot is a's)
            await asyncio.sleep(0.2)
            with pytest.raises(EngineFullError):
                await client.generate([3], p, "c").__anext__()
            await client.shutdown(mode="abort")
            await t2
            for g in (g1, g2):
                async for _ in g:
                    pass

        asyncio.run(main())
    finally:
        client.shutdown_sync(timeout=5)


def test_killed_core_gives_503_and_unhealthy_within_a_second(model_dir):
    import httpx

    from linrnn_server.app import build_app

    client = _client(model_dir)
    try:
        app = build_app(client)

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                assert (await http.get("/health")).status_code == 200
                body = {"model": client.model_name, "prompt": "hello", "max_tokens": 4}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                gen = client.generate([1, 2], SamplingParams(max_tokens=200, ignore_eos=True), "long")
                await gen.__anext__()
                os.kill(client.proc.pid, signal.SIGKILL)
                t0 = time.monotonic()
                with pytest.raises(EngineDeadError):  # the open stream ends, it does not hang
                    async for _ in gen:
                        pass
                while (await http.get("/health")).status_code != 503:
                    assert time.monotonic() - t0 < 1.0, "/health still healthy a second after the core died"
                    await asyncio.sleep(0.01)
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
                assert time.monotonic() - t0 < 1.0

        asyncio.run(main())
    finally:
        client.shutdown_sync(timeout=5)


def test_api_server_process_never_imports_torch():
    """The server process (HTTP, tokenization, detokenization) leaves the model to the core process."""
    import subprocess
    import sys

    code = ("import sys, linrnn_server.app, linrnn_server.cli, linrnn_serve.engine.core_client; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('linrnn_serve.runner', "
            "'linrnn_serve.cache', 'linrnn_kernels'))]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# every SamplingParams field, set to a value other than its default (a new field must be added here, so
# that the test proves it crosses the core's channel)
NON_DEFAULT = dict(
    n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, presence_penalty=0.5, frequency_penalty=-0.5,
    repetition_penalty=1.2, max_tokens=7, min_tokens=2, stop=["x", "yz"], stop_token_ids=[4, 9], ignore_eos=True,
    logprobs=3, prompt_logprobs=2, include_stop_str_in_output=True, skip_special_tokens=False,
    structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    allowed_token_ids=[1, 2, 3], bad_words=["foo", "bar baz"], truncate_prompt_tokens=5,
    bad_words_token_ids=[[1, 2], [3]], logit_bias={5: 2.5, 7: -100.0}, extra_args={"k": [1, "v"], "d": {"x": 1.5}})


def test_every_sampling_param_crosses_the_wire():
    import dataclasses

    from linrnn_serve.engine.protocol import AddRequest, client_decoder, encoder

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(NON_DEFAULT), f"add the new SamplingParams fields to NON_DEFAULT: {fields ^ set(NON_DEFAULT)}"
    default = SamplingParams()
    for name, v in NON_DEFAULT.items():
        assert getattr(default, name) != v, name
    variants = [SamplingParams(**NON_DEFAULT)] + [
        SamplingParams(structured_outputs=so) for so in (
            StructuredOutputsParams(json='{"type": "string"}'), StructuredOutputsParams(regex="[a-c]+"),
            StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(grammar='root ::= "a"'),
            StructuredOutputsParams(json_object=True))]
    for p in variants:
        msg = AddRequest("r", [1, 2, 3], p, 1.5, "text")
        got = client_decoder.decode(encoder.encode(msg))
        assert got == msg and dataclasses.asdict(got.params) == dataclasses.asdict(p)


def _request_cases():
    so = StructuredOutputsParams
    return [
        ("choose: ", SamplingParams(temperature=0, max_tokens=20, structured_outputs=so(choice=["red", "green"]))),
        ("digits ", SamplingParams(temperature=0.8, seed=5, max_tokens=12, structured_outputs=so(regex="[0-9]{3,6}"))),
        ("hello world", SamplingParams(temperature=0, max_tokens=8, bad_words=["the", "fox"], logprobs=1)),
        ("hello world", SamplingParams(temperature=0.9, seed=1, max_tokens=8, allowed_token_ids=list(range(40, 90)))),
        ("The capital of France is Paris. The", SamplingParams(temperature=0, max_tokens=6,
                                                               truncate_prompt_tokens=4, prompt_logprobs=1)),
        ("café", SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=8, presence_penalty=1.0,
                                frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.02, top_k=20,
                                stop_token_ids=[7], min_tokens=3)),
        ("bias", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100.0, 7: -5.0})),
        ("emoji", SamplingParams(temperature=0, max_tokens=8, skip_special_tokens=False, ignore_eos=True,
                                 stop=["o"], include_stop_str_in_output=True)),
    ]


@pytest.mark.parametrize("where", ["process", "thread"])
def test_request_extras_and_prefix_hits_match_the_offline_engine(model_dir, where):
    """Constraints, bad_words, allowed ids, truncation, penalties, n > 1, seeds, stop, prompt logprobs and
    prefix-cache hits (cached_tokens): the core process, and the in-process AsyncLLMEngine (the same deltas
    and consumer states, in a thread), return what the offline engine does."""
    from linrnn_serve.llm import LLM

    kw = dict(KW, enable_prefix_caching=True)
    cases = _request_cases()
    shared = "The quick brown fox jumps over the lazy dog. " * 2  # the second time from the prefix cache
    prompts = [p for p, _ in cases] + [shared, shared]
    params = [c for _, c in cases] + [SamplingParams(temperature=0, max_tokens=4)] * 2
    llm = LLM(model_dir, progress=False, **kw)
    want = [llm.generate([p], [c])[0] for p, c in zip(prompts, params)]  # one at a time: the prefix is cached
    assert want[-1].num_cached_tokens > 0
    if where == "process":
        client = _client(model_dir, enable_prefix_caching=True)
    else:
        from linrnn_serve.engine.async_engine import AsyncLLMEngine

        client = AsyncLLMEngine.from_config(EngineConfig(model=model_dir, **kw), progress=False)
    try:
        async def main():
            return [await _last(client, p, c, f"x{i}") for i, (p, c) in enumerate(zip(prompts, params))]

        got = asyncio.run(main())
        for g, w in zip(got, want):
            assert g.prompt_token_ids == w.prompt_token_ids and g.num_cached_tokens == w.num_cached_tokens
            assert g.prompt_logprobs is None or len(g.prompt_logprobs) == len(w.prompt_logprobs)
            assert [(a.token_ids, a.text, a.finish_reason, a.stop_reason) for a in g.outputs] == \
                   [(b.token_ids, b.text, b.finish_reason, b.stop_reason) for b in w.outputs]
        assert len(got[4].prompt_token_ids) == 4  # truncate_prompt_tokens
        assert got[0].outputs[0].text in ("red", "green")
        assert got[6].outputs[0].token_ids == [42] * 4  # logit_bias +100
    finally:
        client.shutdown_sync(timeout=5)


def test_bad_requests_are_refused_by_the_core_with_typed_errors(model_dir):
    from linrnn_serve.engine.errors import RequestError, StructuredOutputError

    client = _client(model_dir)
    try:
        async def main():
            with pytest.raises(StructuredOutputError) as e:
                await _last(client, "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), "r")
            assert e.value.param == "regex"
            with pytest.raises(RequestError) as e:
                await _last(client, "x", SamplingParams(n=9), "n")  # max_num_seqs 8
            assert e.value.param == "n"
            with pytest.raises(PromptTooLongError) as e:
                await _last(client, [1] * 250, SamplingParams(max_tokens=10), "long")
            assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
            with pytest.raises(RequestError) as e:
                await _last(client, [], SamplingParams(), "empty")
            assert e.value.param == "prompt"
            # and the core still serves
            out = await _last(client, "hello", SamplingParams(temperature=0, max_tokens=3), "ok")
            assert out.finished and len(out.outputs[0].token_ids) == 3

        asyncio.run(main())
    finally:
        client.shutdown_sync(timeout=5)


def test_killing_the_core_of_linrnn_serve_gives_503_and_unhealthy_health():
    """The real `linrnn-serve` (core in its own process by default): SIGKILL the core mid-stream; the
    stream ends, /health and new requests answer 503 within a second, then the server exits (1)."""
    import httpx

    from test_server_e2e import ServerProcess, serve_cmd

    srv = ServerProcess(serve_cmd("--model", "tiny", "--device", "cpu", "--disable-log-stats"))
    try:
        children = open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read().split()
        assert len(children) == 1, children  # the engine core
        core_pid = int(children[0])
        body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(core_pid, signal.SIGKILL)
            t0 = time.monotonic()
            rest = list(lines)  # ends (an error event), does not hang
        assert any('"engine_dead"' in x or "engine" in x for x in rest), rest[-3:]
        h = httpx.get(f"{srv.url}/health", timeout=5)
        c = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert h.status_code == 503 and c.status_code == 503 and c.json()["error"]["code"] == "engine_dead"
        assert srv.proc.wait(30) == 1
    finally:
        srv.stop()
        os.unlink(srv.log_path)
