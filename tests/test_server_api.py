"""The HTTP layer against a small fake engine with AsyncLLMEngine's interface (in-process, fast):
response shapes, streaming frames, the error catalogue, auth, 503, metrics, tokenize."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from starlette.testclient import TestClient

from linrnn_serve.config import EngineConfig
from linrnn_serve.engine.errors import EngineDeadError, EngineFullError
from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput
from linrnn_serve.engine.validation import RequestLimits, validate_request
from linrnn_serve.sampling_params import SamplingParams
from linrnn_server.app import build_app

MODEL_VOCAB = 300  # the fake tokenizer knows ids 0..256 only (like a padded real vocabulary)
EOS = 256


class FakeTokenizer:
    """Byte tokens 0..255 plus one special <|im_end|> (256); ChatML-ish template."""

    vocab_size = 257
    max_id = 256
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("<|im_end|>", i):
                out.append(EOS)
                i += len("<|im_end|>")
            else:
                out += list(text[i].encode("utf-8"))
                i += 1
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts, buf = [], b""
        for t in ids:
            if t < 256:
                buf += bytes([t])
            elif t == EOS and not skip_special_tokens:
                parts.append(buf.decode("utf-8", "replace") + "<|im_end|>")
                buf = b""
        return "".join(parts) + buf.decode("utf-8", "replace")

    def token_bytes(self):
        return [bytes([i]) for i in range(256)] + [None]

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False, **kw):
        for m in messages:
            if "RAISE" in m["content"]:
                raise ValueError("Conversation roles must alternate")
        s = "".join(f"<{m['role']}>{m['content']}<|im_end|>" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Emits letters derived from the prompt, one token per iteration. Knobs: `full` (refuse with
    EngineFullError), `dead`, `fail_after` (raise mid-stream), `gate` (hold before the first token)."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.config = EngineConfig(model="fake", max_num_seqs=4, max_model_len=64)
        self.model_name = "fake-model"
        self.max_model_len = 64
        self.model_config = type("Cfg", (), {"vocab_size": MODEL_VOCAB})()
        self.is_running = True
        self.full = False
        self.dead = False
        self.fail_after: int | None = None
        self.textless: set[int] = set()  # output positions whose token adds no text (a partial UTF-8 char)
        self.gate = threading.Event()
        self.gate.set()
        self.aborted: list[str] = []
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.shutdown_calls: list[tuple[str, float]] = []

    @staticmethod
    def token(prompt: list[int], index: int, k: int) -> int:
        return ord("a") + (sum(prompt) + 3 * k + 7 * index) % 26

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        if self.dead:
            raise EngineDeadError("the engine loop stopped")
        if self.full:
            raise EngineFullError("the waiting queue is full (1 requests); retry later")
        prompt = validate_request(prompt, params, RequestLimits(MODEL_VOCAB, self.max_model_len, 4))  # engine's
        self.submitted.append((request_id, list(prompt), params))
        for _ in range(2000):  # bounded wait on the gate
            if self.gate.is_set():
                break
            await asyncio.sleep(0.005)
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt))
        outs = [CompletionOutput(i, "", [], [] if params.logprobs is not None else None) for i in range(params.n)]
        plp = None
        if params.prompt_logprobs is not None:
            plp = [None] + [{t: -1.0, 1: -2.0} for t in prompt[1:]]
        for k in range(max_tokens):
            if self.fail_after is not None and k == self.fail_after:
                raise RuntimeError("simulated engine failure")
            for c in outs:
                t = self.token(prompt, c.index, k)
                c.token_ids.append(t)
                c.text += "" if k in self.textless else chr(t)
                if c.logprobs is not None:
                    alts = {t: -0.25}
                    for j in range(params.logprobs):
                        alts.setdefault(ord("A") + j, -1.0 - j)
                    c.logprobs.append(alts)
                for s in params.stop:
                    if s in c.text:
                        c.text = c.text[: c.text.index(s)]
                        c.finish_reason, c.stop_reason = "stop", s
            last = k == max_tokens - 1
            for c in outs:
                if c.finish_reason is None and last:
                    c.finish_reason = "length"
            done = all(c.finish_reason for c in outs)
            yield RequestOutput(request_id, None, list(prompt),
                                [CompletionOutput(c.index, c.text, list(c.token_ids),
                                                  list(c.logprobs) if c.logprobs is not None else None,
                                                  c.finish_reason, c.stop_reason) for c in outs], done, plp)
            if done:
                return
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0,
                "state_cache_usage": 0.0, "num_preemptions_total": 0, "request_success_total": {"stop": 2},
                "time_to_first_token_seconds": {"buckets": [(0.1, 1), (float("inf"), 2)], "sum": 0.3, "count": 2}}

    async def shutdown(self, mode: str = "abort", timeout: float = 30.0) -> None:
        self.shutdown_calls.append((mode, timeout))


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, served_model_names=["fake-model", "alias"])) as c:
        yield c


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(r, status: int, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and isinstance(err["message"], str)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- happy paths --------------------------------------------------------------------------------
def test_models(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["fake-model", "alias"]
    assert data["data"][0]["max_model_len"] == 64 and data["data"][0]["object"] == "model"
    assert client.get("/v1/models/alias").json()["id"] == "alias"
    assert_error(client.get("/v1/models/nope"), 404, "model", "model_not_found")


def test_completion(client, engine):
    r = client.post("/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "alias"
    (choice,) = body["choices"]
    expect = "".join(chr(FakeEngine.token([104, 105], 0, k)) for k in range(5))
    assert choice == {"index": 0, "text": expect, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    # defaults: OpenAI's max_tokens 16 and temperature 1; the model field is optional
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "n": null, "temperature": null}')  # no Content-Type
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    p = engine.submitted[-1][2]
    assert p.temperature == 1.0 and p.max_tokens == 16 and p.n == 1


def test_completion_prompt_forms_and_n(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "c"], "n": 2, "max_tokens": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    ids = client.post("/v1/completions", json={"prompt": [[97, 98], [99]], "n": 2, "max_tokens": 3}).json()
    assert [c["text"] for c in ids["choices"]] == [c["text"] for c in body["choices"]]
    one = client.post("/v1/completions", json={"prompt": [97, 98], "max_tokens": 3}).json()
    assert one["choices"][0]["text"] == body["choices"][0]["text"]


def test_completion_echo_and_logprobs(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 2, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    assert c["text"].startswith("hey") and len(c["text"]) == 5
    lp = c["logprobs"]
    assert lp["tokens"] == ["h", "e", "y", c["text"][3], c["text"][4]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-1.0, -1.0, -0.25, -0.25]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["top_logprobs"][3] == {c["text"][3]: -0.25, "A": -1.0, "B": -2.0}
    assert engine.submitted[-1][2].prompt_logprobs == 2
    # token-id prompt echoes its decoded text
    r = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 1, "echo": True})
    assert r.json()["choices"][0]["text"].startswith("hi")


def test_completion_stream(client):
    full = client.post("/v1/completions", json={"prompt": ["ab", "c"], "n": 2, "max_tokens": 4}).json()
    r = client.post("/v1/completions", json={"prompt": ["ab", "c"], "n": 2, "max_tokens": 4, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    texts, finish = {}, {}
    for e in events[:-2]:
        assert e["object"] == "text_completion" and e["usage"] is None
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert finish == {0: "length", 1: "length", 2: "length", 3: "length"}
    # without include_usage: no usage chunk
    events = sse_events(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}).text)
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_stream_sends_a_chunk_per_output_even_without_text(client, engine):
    """Tokens that add no text yet (a partial UTF-8 character, a held-back stop-string prefix) still get
    their chunk, as in vLLM: clients time tokens by chunks (TTFT, ITL); skipping them made bursts."""
    engine.textless = {0, 1, 2, 4, 5}
    events = sse_events(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True}).text)
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert events[-1] == "[DONE]" and len(texts) == 8
    assert [t == "" for t in texts] == [k in engine.textless for k in range(8)]
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}).text)
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]  # after the role chunk
    assert len(deltas) == 8 and [d.get("content") == "" for d in deltas] == [k in engine.textless for k in range(8)]


def test_stop_strings(client):
    full = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 8}).json()["choices"][0]["text"]
    stop = full[3:5]
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 8, "stop": stop}).json()["choices"][0]
    assert r["text"] == full[: full.index(stop)] and r["finish_reason"] == "stop" and r["stop_reason"] == stop


def test_chat(client, engine):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}]
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": msgs,
                                                   "max_completion_tokens": 3, "max_tokens": 9})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    prompt = "<system>be brief<|im_end|><user>hello<|im_end|><assistant>"
    assert engine.submitted[-1][1] == FakeTokenizer().encode(prompt)
    (c,) = body["choices"]
    assert c["message"]["role"] == "assistant" and len(c["message"]["content"]) == 3
    assert c["finish_reason"] == "length" and c["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len(FakeTokenizer().encode(prompt))
    assert body["usage"]["completion_tokens"] == 3
    # neutral values of unsupported features are accepted; metadata-only fields are ignored
    r = client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 1, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "logit_bias": {}, "user": "u", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True})
    assert r.status_code == 200, r.text


def test_unknown_fields_are_accepted_with_a_warning(client, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 1, "priority": 3})
        assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                      "zz_unknown": {"a": 1}})
        assert r.status_code == 200, r.text
    assert "frobnicate" in caplog.text and "zz_unknown" in caplog.text


def test_chat_stream_and_logprobs(client):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "logprobs": True,
           "top_logprobs": 2}
    full = client.post("/v1/chat/completions", json=req).json()
    lp = full["choices"][0]["logprobs"]["content"]
    assert len(lp) == 3
    assert lp[0]["logprob"] == -0.25 and lp[0]["bytes"] == list(lp[0]["token"].encode())
    assert [t["token"] for t in lp[0]["top_logprobs"]] == [lp[0]["token"], "A"]  # the 2 most likely, sorted
    events = sse_events(client.post("/v1/chat/completions", json={
        **req, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == full["usage"] and events[-2]["choices"] == []
    chunks = events[:-2]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert [e["choices"][0]["delta"] for e in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    text, tokens = {}, {}
    for e in chunks[2:]:
        c = e["choices"][0]
        text[c["index"]] = text.get(c["index"], "") + (c["delta"]["content"] or "")
        tokens[c["index"]] = tokens.get(c["index"], []) + (c["logprobs"]["content"] if c["logprobs"] else [])
    assert text == {c["index"]: c["message"]["content"] for c in full["choices"]}
    assert tokens[0] == lp


# ---- errors -------------------------------------------------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}]}

BAD_REQUESTS = [
    # (route, body, status, param, code)
    ("/v1/completions", b'{"prompt": ', 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", b"\xff\xfe", 400, None, "invalid_json"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-", "guided_choice": ["a"]}, 400, "guided_choice", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 5}, 400, "n", "invalid_value"),  # > max_num_seqs (4)
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(MODEL_VOCAB): 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, 400,
     "stream_options.bogus", "unknown_parameter"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x" * 70}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x" * 40, "max_tokens": 30}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [1, MODEL_VOCAB]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, 400,
     "messages[0].mood", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools", None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "auto"}, 400, "tool_choice", None),  # no --enable-auto-tool-choice
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format", None),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format", None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 100}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "RAISE"}]}, 400, "messages",
     "chat_template_error"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", None),
    ("/tokenize", {"prompt": "x", "messages": CHAT["messages"]}, 400, "prompt", None),
    ("/detokenize", {"tokens": [1, 299]}, 400, "tokens", None),
]


@pytest.mark.parametrize("route,body,status,param,code", BAD_REQUESTS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else json.dumps(b)[:40]}"
                              for i, (_, b, *_r) in enumerate(BAD_REQUESTS)])
def test_bad_requests(client, engine, route, body, status, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    assert_error(client.post(route, **kw), status, param, code)
    assert not engine.submitted  # nothing reached the engine
    ok = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})  # and the server still serves
    assert ok.status_code == 200


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_engine_full_is_503(client, engine):
    engine.full = True
    for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT),
                        ("/v1/completions", {"prompt": "x", "stream": True})):
        r = client.post(route, json=body)
        err = assert_error(r, 503, None, "server_overloaded")
        assert "queue" in err["message"] and r.headers["retry-after"] == "1"
    engine.full = False
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_engine_dead(client, engine):
    engine.dead = True
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503, None, "engine_dead")
    engine.is_running = False
    assert_error(client.get("/health"), 503)


def test_engine_failure_mid_stream_and_not(client, engine):
    engine.fail_after = 2
    events = sse_events(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}).text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_server_error"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) != ""
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}), 500)
    engine.fail_after = None
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}).status_code == 200


def test_api_key(engine):
    with TestClient(build_app(engine, api_key="s3cret")) as c:
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        for path, method in (("/v1/models", "get"), ("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                             ("/tokenize", "post"), ("/detokenize", "post")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):
                r = getattr(c, method)(path, headers=headers, **({"json": {}} if method == "post" else {}))
                assert_error(r, 401, None, "invalid_api_key")
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/v1/completions", headers=ok, json={"prompt": "x", "max_tokens": 1}).status_code == 200
        assert not engine.submitted[1:]  # only the authorized request reached the engine


def test_tokenize_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert r["tokens"] == list("héllo".encode()) and r["count"] == 6 and r["max_model_len"] == 64
    r = client.post("/tokenize", json={"messages": CHAT["messages"], "return_token_strs": True}).json()
    assert r["tokens"] == FakeTokenizer().encode("<user>hi<|im_end|><assistant>") and len(r["token_strs"]) == r["count"]
    assert client.post("/detokenize", json={"tokens": list("héllo".encode())}).json() == {"prompt": "héllo"}


def test_metrics(client):
    client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    lab = 'model_name="fake-model"'
    assert f"linrnn:num_requests_running{{{lab}}} 0" in text
    assert f"linrnn:kv_cache_usage_perc{{{lab}}} 0.0" in text and "# TYPE linrnn:kv_cache_usage_perc gauge" in text
    assert "# TYPE linrnn:num_preemptions_total counter" in text
    assert f'linrnn:request_success_total{{{lab},finished_reason="stop"}} 2' in text
    assert f'linrnn:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} 2' in text
    assert f"linrnn:time_to_first_token_seconds_count{{{lab}}} 2" in text
    assert f'linrnn:request_refused_total{{{lab},status="404"}} 1' in text
    # vLLM's names beside ours (prometheus_client)
    assert f"vllm:num_requests_running{{{lab}}} 0.0" in text and "# TYPE vllm:num_requests_running gauge" in text
    assert f"vllm:kv_cache_usage_perc{{{lab}}} 0.0" in text and "# TYPE vllm:num_preemptions_total counter" in text
    assert f'vllm:request_success_total{{finished_reason="stop",{lab}}} 2.0' in text
    assert f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{lab}}} 2.0' in text
    assert f"vllm:time_to_first_token_seconds_count{{{lab}}} 2.0" in text


def test_shutdown_stops_engine(engine):
    with TestClient(build_app(engine, shutdown_mode="finish", shutdown_timeout=3.0)) as c:
        assert c.get("/health").status_code == 200
    assert engine.shutdown_calls == [("finish", 3.0)]


def test_logprob_text_offsets_match_incremental_utf8_decoding():
    """_LogprobBuilder's ASCII shortcut gives the offsets of decoding every token's bytes incrementally,
    characters split across tokens included (fresh random splits of mixed-width text)."""
    import codecs
    import random

    from linrnn_server.routes.completions import _LogprobBuilder
    from linrnn_server.protocol import CompletionLogprobs

    rng = random.Random(7)
    text = "".join(rng.choice(["a", "Z", " ", "é", "ß", "中", "😀", "\n"]) for _ in range(400)).encode()
    cuts = sorted(rng.sample(range(1, len(text)), 250))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]

    class Eng:
        def token_bytes(self, tid):
            return pieces[tid]

        def is_special(self, tid):
            return False

    b = _LogprobBuilder(Eng(), as_ids=True)
    lp = CompletionLogprobs()
    for start in range(0, len(pieces), 7):  # stream chunks of up to 7 tokens
        ids = list(range(start, min(start + 7, len(pieces))))
        b.add(lp, ids, [{i: -1.0} for i in ids])
    ref, dec, off = [], codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
    for p in pieces:
        ref.append(off)
        off += len(dec.decode(p))
    assert lp.text_offset == ref and any(not p.isascii() for p in pieces)


def test_event_stream_sends_from_the_route_task_and_stops_on_disconnect():
    """EventStreamResponse: frames go out from the task that awaits the response (no extra loop turn
    before the first token), a disconnect cancels the body (its cleanup runs: the request's abort), and
    a body's error comes out as itself, not wrapped in an exception group."""
    import asyncio

    from linrnn_server.rendering import EventStreamResponse

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}

    async def run(fail: bool):
        route_task, body_tasks, sent, cleaned = asyncio.current_task(), [], [], []
        gone = asyncio.Event()

        async def body():
            try:
                body_tasks.append(asyncio.current_task())
                yield b"data: 1\n\n"
                if fail:
                    raise ValueError("engine failed")
                await asyncio.sleep(30)  # the client leaves meanwhile
                yield b"data: 2\n\n"
            finally:
                cleaned.append(True)

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)
            if msg.get("body") == b"data: 1\n\n":
                gone.set()

        async with asyncio.timeout(5):  # (wait_for would run it in another task)
            await EventStreamResponse(body())(scope, receive, send)
        assert body_tasks == [route_task] and cleaned == [True]
        return [m.get("body") for m in sent if m["type"] == "http.response.body"]

    assert asyncio.run(run(False)) == [b"data: 1\n\n"]
    with pytest.raises(ValueError, match="engine failed"):
        asyncio.run(run(True))


def test_until_disconnect_runs_in_the_route_task_and_cancels_on_disconnect():
    """until_disconnect: the awaited coroutine runs in the caller's task (the hand-over to the engine
    starts without another loop turn); a disconnect cancels it (its cleanup runs) and raises
    ClientDisconnected; the caller's task is not left cancelled."""
    import asyncio

    from linrnn_server.serving import ClientDisconnected, until_disconnect

    class Req:
        def __init__(self):
            self.gone = asyncio.Event()

        async def receive(self):
            await self.gone.wait()
            return {"type": "http.disconnect"}

    async def main():
        route, ran_in, cleaned = asyncio.current_task(), [], []

        async def work(wait: bool):
            ran_in.append(asyncio.current_task())
            try:
                if wait:
                    await asyncio.sleep(30)
                return 7
            finally:
                cleaned.append(wait)

        assert await until_disconnect(Req(), work(False)) == 7
        req = Req()
        asyncio.get_running_loop().call_later(0.05, req.gone.set)
        with pytest.raises(ClientDisconnected):
            await until_disconnect(req, work(True))
        assert ran_in == [route, route] and cleaned == [False, True]
        assert route.cancelling() == 0
        await asyncio.sleep(0)  # still usable
        return True

    assert asyncio.run(main())
