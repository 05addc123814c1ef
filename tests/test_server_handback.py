"""The API server's share of a c = 64 wave's hand-back (issue #14): a finished stream ends in one write, and
the generation routes reach their endpoint without FastAPI's router (benchmarks/results/serving/handback_cpu/)."""
from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from linrnn_server.app import build_app
from test_server_api import FakeEngine, assert_error, sse_events

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
         "client": ("127.0.0.1", 5555)}


def asgi_post(app, path: str, body: dict) -> list[dict]:
    """The ASGI messages the app sends for one POST, driven directly (no test client in between: each
    message is one write of the HTTP server)."""
    raw = json.dumps(body).encode()
    scope = {**SCOPE, "path": path, "raw_path": path.encode(),
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    sent: list[dict] = []

    async def main():
        done = asyncio.Event()
        first = [True]

        async def receive():
            if first[0]:
                first[0] = False
                return {"type": "http.request", "body": raw, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                done.set()

        async with asyncio.timeout(10):
            await app(scope, receive, send)

    asyncio.run(main())
    return sent


@pytest.mark.parametrize("path,n", [("/v1/completions", 1), ("/v1/completions", 2), ("/v1/chat/completions", 1),
                                    ("/v1/chat/completions", 2)])
def test_finished_stream_ends_in_one_write(path, n):
    """The last choice's final chunk, the usage chunk, [DONE] and the end of the response go out as one ASGI
    message (one write: uvicorn puts the chunked encoding's terminator in the same write); every engine output
    before it is a message of its own, sent as it comes."""
    engine = FakeEngine()
    app = build_app(engine, served_model_names=["fake-model"])
    body = {"max_tokens": 4, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    sent = asgi_post(app, path, body)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m for m in sent[1:] if m["type"] == "http.response.body"]
    assert all(m.get("more_body") for m in bodies[:-1]) and bodies[-1]["more_body"] is False
    last = sse_events(bodies[-1]["body"].decode())
    assert last[-1] == "[DONE]" and last[-2]["usage"]["completion_tokens"] == 4 * n
    assert last[0]["choices"][0]["finish_reason"] == "length"
    # the same stream as the test client reads it: every token, each finish reason once
    events = [e for m in bodies for e in sse_events(m["body"].decode())]
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] * n
    # one message per choice per engine output (4 outputs) and, in chat, each choice's role chunk first: with n = 2
    # the first choice's final chunk goes out at once, only the last one's waits for usage and [DONE]
    assert len(bodies) == 4 * n + (n if path == "/v1/chat/completions" else 0)


def test_stream_error_after_the_last_choice_keeps_its_frames():
    """An engine error mid-stream still ends the stream with the error event and [DONE], in one message."""
    engine = FakeEngine()
    engine.fail_after = 2
    sent = asgi_post(build_app(engine), "/v1/completions", {"prompt": "x", "max_tokens": 5, "stream": True})
    last = sse_events(sent[-1]["body"].decode())
    assert sent[-1]["more_body"] is False and last[-1] == "[DONE]" and last[-2]["error"]["type"] == \
        "internal_server_error"


class CountingRouter:
    """FastAPI's router with its calls counted."""

    def __init__(self, router):
        self.router, self.calls = router, []

    def __getattr__(self, name):
        return getattr(self.router, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.calls.append((scope["method"], scope["path"]))
        await self.router(scope, receive, send)


@pytest.mark.parametrize("api_key", [None, "s3cret"])
def test_generation_routes_skip_the_router(api_key):
    """POST /v1/completions and /v1/chat/completions go straight to their endpoints (DirectRoutes), with the API
    key checked and errors rendered as through the router; every other request still goes through it."""
    engine = FakeEngine()
    app = build_app(engine, served_model_names=["fake-model"], api_key=api_key)
    router = app.router = CountingRouter(app.router)  # before the first request builds the middleware stack
    ok = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with TestClient(app) as c:
        r = c.post("/v1/completions", headers=ok, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = c.post("/v1/chat/completions", headers=ok, json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
        assert_error(c.post("/v1/completions", headers=ok, content=b"{nope"), 400, None, "invalid_json")
        assert_error(c.post("/v1/completions", headers=ok, json={"prompt": "x", "model": "nope"}), 404, "model",
                     "model_not_found")
        assert router.calls == []
        if api_key:
            assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 401, None, "invalid_api_key")
            assert_error(c.post("/v1/chat/completions", headers={"Authorization": "Bearer no"}, json={}), 401, None,
                         "invalid_api_key")
            assert router.calls == []
        assert_error(c.get("/v1/completions", headers=ok), 405)
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/tokenize", headers=ok, json={"prompt": "hi"}).json()["count"] == 2
        assert router.calls == [("GET", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")]
    assert len(engine.submitted) == 2


def test_server_cpu_tool():
    """benchmarks/server_cpu.py (the CPU per wave phase of the README's table) runs and sees one write per
    finished stream."""
    from linrnn_bench.server_cpu import PHASES, measure

    r = asyncio.run(measure(requests=4, rounds=1, settle_s=0.005))
    assert set(r["cpu"]) == set(PHASES) and all(v["min_ms"] > 0 for v in r["cpu"].values())
    assert r["body_messages_per_finished_stream"] == 1
