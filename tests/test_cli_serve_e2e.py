"""`linrnn-serve X` and `linrnn-serve --model X` serve the same thing; the logging flags act (the real
server process, tiny model, CPU)."""
from __future__ import annotations

import sys
import time

import httpx
import pytest

from test_server_e2e import ServerProcess

pytest.importorskip("openai")


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "linrnn_serve", *args, "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
            "--stats-interval", "0.3"]


def _complete(s: ServerProcess) -> dict:
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "def main():", "max_tokens": 8, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_positional_model_and_log_flags():
    a = ServerProcess(_cmd("tiny", "--uvicorn-log-level", "warning"))  # `linrnn-serve MODEL`
    try:
        out_a, models_a = _complete(a), httpx.get(f"{a.url}/v1/models").json()
        time.sleep(0.8)
        log_a = a.tail(20000)
    finally:
        a.stop()
    b = ServerProcess(_cmd("serve", "--model", "tiny", "--disable-log-requests", "--disable-log-stats",
                           "--trust-remote-code", "-tp", "1", "--enable-prefix-caching", "--kv-cache-dtype", "auto",
                           "--enable-chunked-prefill", "--max-logprobs", "20", "--generation-config", "auto"))
    try:
        out_b, models_b = _complete(b), httpx.get(f"{b.url}/v1/models").json()
        time.sleep(0.8)
        log_b = b.tail(20000)
    finally:
        b.stop()
    assert models_a["data"][0]["id"] == models_b["data"][0]["id"] == "tiny"
    assert out_a["choices"][0]["text"] == out_b["choices"][0]["text"]
    assert "request cmpl-" in log_a and "avg prompt throughput" in log_a
    assert "request cmpl-" not in log_b and "avg prompt throughput" not in log_b
    assert "no remote code is run" in log_b


def test_unsupported_flags_fail_in_one_line():
    import subprocess

    for args, want in ((["tiny", "--kv-cache-dtype", "fp8"], "fp8 KV cache is not implemented"),
                       (["tiny", "--speculative-config", "{}"], "speculative decoding is not implemented")):
        p = subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and want in p.stderr + p.stdout
