"""Structured output through the real server and the `openai` client: 20 JSON schemas (nested objects,
arrays, enums, bounded numbers), streaming and not, greedy and temperature 1, all validated with
`jsonschema`; regex and choice likewise; a batch mixing constrained and free requests leaves the free
ones' greedy output as it is alone.

They run on the embedded default model (the acceptance line's model; LINRNN_STRUCTURED_MODEL=tiny
picks another), one server for the module, all 80 schema requests in one concurrent batch.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import pytest

from structured_schemas import SCHEMAS
from test_server_e2e import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = os.environ.get("LINRNN_STRUCTURED_MODEL", "default")
MODES = [(stream, temp) for temp in (0.0, 1.0) for stream in (False, True)]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess([sys.executable, "-m", "linrnn_serve", "serve", MODEL, "--host", "127.0.0.1", "--port", "0",
                       "--device", "cpu", "--max-num-seqs", "96", "--disable-log-stats", "--disable-log-requests"])
    yield s
    s.stop()


def _client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)


async def _chat(c, stream: bool, **kw) -> str:
    msgs = [{"role": "user", "content": "Reply in JSON."}]
    if not stream:
        r = await c.chat.completions.create(model=MODEL, messages=msgs, **kw)
        return r.choices[0].message.content
    text = ""
    async for ch in await c.chat.completions.create(model=MODEL, messages=msgs, stream=True, **kw):
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
    return text


def _check_schemas(server, cases: list[tuple[int, bool, float]]) -> None:
    async def run():
        c = _client(server)
        jobs = []
        for i, stream, temp in cases:
            rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}
            jobs.append(_chat(c, stream, response_format=rf, temperature=temp, seed=i, max_tokens=64))
        return await asyncio.gather(*jobs)

    texts = asyncio.run(run())
    bad = []
    for (i, stream, temp), text in zip(cases, texts):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            bad.append(f"schema {i} stream={stream} T={temp}: {text!r} ({str(e)[:60]})")
    assert not bad, "\n".join(bad)


def test_twenty_json_schemas_streaming_and_not_greedy_and_sampled(server):
    """All 20 x 4 at once (one batch: ~30 s on the CPU with the default model)."""
    assert len(SCHEMAS) == 20
    _check_schemas(server, [(i, stream, temp) for i in range(len(SCHEMAS)) for stream, temp in MODES])


def test_regex_choice_json_object_and_mixed_batch(server):
    async def run():
        c = _client(server)
        free = dict(max_tokens=12, temperature=0)
        alone = await _chat(c, False, **free)
        jobs = [_chat(c, s, extra_body={"guided_regex": r"[a-z]{3}-[0-9]{2,4}"}, max_tokens=16, temperature=t, seed=1)
                for s in (False, True) for t in (0, 1)]
        jobs += [_chat(c, s, extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, max_tokens=8,
                       temperature=t, seed=2) for s in (False, True) for t in (0, 1)]
        jobs += [_chat(c, False, response_format={"type": "json_object"}, max_tokens=48, temperature=0)]
        jobs += [_chat(c, False, **free), _chat(c, True, **free)]
        return alone, await asyncio.gather(*jobs)

    alone, outs = asyncio.run(run())
    regex, choice, obj, free = outs[:4], outs[4:8], outs[8], outs[9:]
    assert all(re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", t) for t in regex), regex
    assert all(t in ("alpha", "beta", "gamma") for t in choice), choice
    assert obj.startswith("{")  # json_object: a JSON object (complete unless max_tokens cut it)
    assert free == [alone, alone]  # the free requests of the mixed batch: the same greedy text as alone
