"""`linrnn-serve --model tiny --device cpu --tensor-parallel-size 2`: one worker process beside the
engine core (gloo on 127.0.0.1) serves HTTP with the single-process greedy output; killing the
worker makes the server answer 503 and exit (status 1) instead of hanging."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from test_server_e2e import ServerProcess, serve_cmd

PROMPTS = ["hello world", "The capital of France is"]


@pytest.fixture(scope="module")
def single_process_texts():
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.sampling_params import SamplingParams

    e = LLMEngine.from_engine_args("tiny", device="cpu", max_num_seqs=4, progress=False)
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                out[int(o.request_id)] = o.outputs[0].text
    return [out[i] for i in range(len(PROMPTS))]


def complete(server, prompt: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_tp2_server_matches_single_process_and_a_killed_worker_gives_503_and_exit(single_process_texts, ep):
    extra = ["--enable-expert-parallel"] if ep else []
    srv = ServerProcess(serve_cmd("--model", "tiny", "--device", "cpu", "--tensor-parallel-size", "2",
                                  "--max-num-seqs", "4", *extra))
    try:
        for prompt, want in zip(PROMPTS, single_process_texts):
            r = complete(srv, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        m = re.search(r"worker pids (\d+)", srv.tail(100000))
        assert m, srv.tail()
        os.kill(int(m.group(1)), signal.SIGKILL)
        r = complete(srv, PROMPTS[0])
        assert r.status_code == 503, r.text
        assert srv.proc.wait(30) == 1  # exits on its own, never hangs
        assert "tensor-parallel rank 1 exited" in srv.tail(100000)
    finally:
        srv.stop()
