"""Limits (issue #18), in process and fast: the request-body limit (413, declared or chunked), 503 while
draining, the default max_tokens policy, the early context-length refusal, --max-model-len above the
model's max_position_embeddings, and the memory check before a model is built. The real-server
versions (50 MB prompts, SIGTERM under load) are in test_server_abuse.py."""
from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from linrnn_server.app import build_app
from test_server_api import FakeEngine, assert_error


@pytest.fixture
def engine():
    return FakeEngine()


def test_body_limit_413(engine):
    with TestClient(build_app(engine, max_request_bytes=1000)) as c:
        ok = c.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 2})
        assert ok.status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 2})
        assert_error(r, 413, code="request_too_large")
        assert "1000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: cut off once past the limit
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"y" * 100
            yield b'"}'

        assert_error(c.post("/v1/completions", content=chunks()), 413, code="request_too_large")
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert len(engine.submitted) == 2  # the oversized ones never reached the engine


def test_draining_refuses_new_requests(engine):
    app = build_app(engine)
    with TestClient(app) as c:
        state = app.state.server
        state.draining = True
        assert_error(c.post("/v1/completions", json={"prompt": "x"}), 503, code="shutting_down")
        assert_error(c.get("/health"), 503, code="shutting_down")
        assert c.get("/metrics").status_code == 200
        state.draining = False
        assert c.get("/health").status_code == 200


def test_drain_aborts_what_is_left(engine):
    """ServerState.drain: waits for requests in flight, then aborts what is left before the timeout."""
    app = build_app(engine)
    state = app.state.server

    async def main():
        state.active.update({"a", "b"})

        async def finish_a():
            await asyncio.sleep(0.1)
            state.active.discard("a")

        async def engine_aborts():  # the engine's abort ends the stream, which leaves `active`
            while "b" not in engine.aborted:
                await asyncio.sleep(0.01)
            state.active.discard("b")

        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(state.drain(1.5), finish_a(), engine_aborts())
        return asyncio.get_running_loop().time() - t0

    took = asyncio.run(main())
    assert state.draining and engine.aborted == ["b"] and not state.active
    assert 0.9 <= took < 1.5  # aborted a third of the timeout before its end


def test_default_max_tokens_policy(engine):
    with TestClient(build_app(engine, default_max_tokens=5)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7})
        assert r.json()["usage"]["completion_tokens"] == 7  # an explicit limit wins
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": None})
        assert r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
        # a long prompt: capped by the context (max_model_len 64) instead of being refused
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 40}]})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 64
    with TestClient(build_app(FakeEngine())) as c:  # no cap: up to the context limit (vLLM)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == 64


def test_long_prompt_refused_before_tokenizing():
    from linrnn_serve.engine.tokenizer import Tokenizer
    from linrnn_serve.presets import default_model_dir

    tok = Tokenizer.from_dir(default_model_dir())
    for text in ("hello wörld 日本語 🎉 " * 50, "def f(x):\n    return x\n" * 100):
        assert 0 < tok.min_tokens(text) <= len(tok.encode(text))
        assert tok.min_tokens([text, text]) <= len(tok.encode(text + text))

    class Counting(FakeEngine):
        def __init__(self):
            super().__init__()
            calls = self.calls = []
            tok = self.tokenizer
            enc = tok.encode

            def encode(text, add_special_tokens=True):
                calls.append(len(text))
                return enc(text, add_special_tokens)

            tok.encode = encode
            tok.min_tokens = lambda t: sum(len(x.encode()) for x in ([t] if isinstance(t, str) else t))

    eng = Counting()
    with TestClient(build_app(eng)) as c:
        big = "z" * 100_000
        assert_error(c.post("/v1/completions", json={"prompt": big}), 400, "prompt", "context_length_exceeded")
        assert_error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]}), 400,
                     "messages", "context_length_exceeded")
        assert eng.calls == []  # neither was tokenized (nor the chat one rendered)
        assert c.post("/v1/completions", json={"prompt": "z" * 20, "max_tokens": 4}).status_code == 200


# ---- engine start-up limits ---------------------------------------------------------------------------
def test_max_model_len_above_the_model_needs_the_flag(tmp_path):
    from engine_fixtures import make_tiny_model_dir
    from linrnn_serve.config import EngineConfig, ModelConfig
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_server.engine_client import EngineClient

    d = make_tiny_model_dir(tmp_path / "m")
    limit = ModelConfig.from_pretrained(d).max_position_embeddings
    with pytest.raises(ValueError, match="--allow-long-max-model-len"):
        LLMEngine(EngineConfig(model=d, max_model_len=limit + 1), progress=False)
    eng = LLMEngine(EngineConfig(model=d, max_model_len=limit + 1, allow_long_max_model_len=True), progress=False)
    assert eng.max_model_len == limit + 1
    app = build_app(eng, owns_engine=False)
    with TestClient(app) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == limit + 1
    assert EngineClient(eng).max_model_len == limit + 1


def test_serve_cli_refuses_long_max_model_len(caplog):
    from linrnn_server import cli

    p = __import__("argparse").ArgumentParser()
    cli.add_arguments(p)
    rc = cli.run(p.parse_args(["--model", "tiny", "--device", "cpu", "--max-model-len", "100000",
                               "--host", "127.0.0.1", "--port", "0"]))
    assert rc == 1
    assert "pass --allow-long-max-model-len" in caplog.text


def test_model_that_cannot_fit_is_refused_before_building(monkeypatch):
    import time

    import linrnn_serve.models.loading as loading
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(loading, "cpu_available_bytes", lambda: 4 << 30)
    t0 = time.monotonic()
    with pytest.raises(loading.InsufficientMemoryError, match=r"needs \d+\.\d GiB .* 4\.0 GiB available"):
        LLMEngine(EngineConfig(model="qwen35moe-nvfp4", load_format="dummy", device="cpu"), progress=False)
    assert time.monotonic() - t0 < 60  # the estimate builds nothing (meta device)
    tiny = loading.weight_bytes(__import__("linrnn_serve.presets", fromlist=["x"]).resolve_model("tiny").cfg,
                                __import__("torch").float32)
    assert 0 < tiny < 4 << 30


def test_server_trace_events_leave_the_gc():
    """serve_probe's trace (100k+ events a GPU run) must not lengthen the traced server's full collections."""
    import gc

    from linrnn_bench.serve_probe import ServerTrace

    trace = ServerTrace()
    trace.add("recv", 1.5, [("cmpl-a", 3), ("cmpl-b", 4)])
    trace.add("add_sent", 2.5, "cmpl-a")
    trace.add("sse", 3.5, [("cmpl-a", 3)], 1e-5)
    for _ in range(2):  # a collection untracks the inner tuples, the next one the event holding them
        gc.collect()
    assert [gc.is_tracked(e) for e in trace.events] == [False] * 3
    assert trace.events[0] == ("recv", 1.5, (("cmpl-a", 3), ("cmpl-b", 4)))
