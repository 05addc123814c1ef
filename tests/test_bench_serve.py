"""`bench serve` measures TTFT / TPOT / ITL correctly against a fake streaming server with known
delays (issue #7)."""
import asyncio
import json
import os
import socket
import sys
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from linrnn_bench.serve import format_table, random_prompts, run_benchmark  # noqa: E402

FIRST, GAP, N = 0.15, 0.05, 6  # first token after 150 ms, then one every 50 ms, 6 tokens
# the server's timers may fire up to a millisecond early (uvloop / libuv keep time in whole milliseconds): a measured
# TTFT is at least the first token's sleep less this
EARLY_MS = 2
PROMPTS = []  # every prompt the fake server got


def _fake_app():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        PROMPTS.append(body["prompt"])
        rid = f"cmpl-{len(PROMPTS)}"
        ids = body.get("return_tokens_as_token_ids")

        async def gen():
            await asyncio.sleep(FIRST)
            for i in range(N):
                if i:
                    await asyncio.sleep(GAP)
                choice = {"index": 0, "text": f"t{i}"}
                if ids:
                    choice["logprobs"] = {"tokens": [f"token_id:{7000 + i}"]}
                yield "data: " + json.dumps({"id": rid, "choices": [choice]}) + "\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": N, "total_tokens": 0,
                     "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(timeout=10)


def test_latency_definitions(fake_server):
    prompts = random_prompts(8, 16, 0, (100, 200))
    r = asyncio.run(run_benchmark(fake_server, "m", prompts[4:], N, max_concurrency=4, warmup_prompts=prompts[:4]))
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["output_tokens"] == 4 * N and r["input_tokens"] == 4 * 16
    # known delays, with slack for a loaded machine (never faster than the server's sleeps)
    assert FIRST * 1000 - EARLY_MS <= r["ttft_ms"]["median"] < FIRST * 1000 + 80
    assert GAP * 1000 - EARLY_MS <= r["itl_ms"]["median"] < GAP * 1000 + 25
    assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
    assert "| 4 |" in format_table([r])


def test_per_request_relations(fake_server):
    """E2EL = TTFT + sum(ITL) (to the last chunk), TPOT = (E2EL - TTFT) / (out - 1), exactly."""
    from linrnn_bench.http_client import StreamClient
    from linrnn_bench.serve import send_request, summarize

    async def go():
        async with StreamClient(fake_server) as c:
            return [await send_request(c, "m", [1, 2, 3], N) for _ in range(2)]
    res = asyncio.run(go())
    for x in res:
        assert x.ok and x.output_tokens == N and len(x.itl) == N - 1
        assert x.latency >= x.ttft + sum(x.itl) - 1e-9
        assert x.latency - (x.ttft + sum(x.itl)) < 0.02  # usage + [DONE] follow the last token at once
    summ = summarize(res, 1.0)
    want = sorted((x.latency - x.ttft) / (N - 1) for x in res)
    assert summ["tpot_ms"]["mean"] == pytest.approx(1000 * sum(want) / 2)


def test_concurrency_limit_serialises(fake_server):
    prompts = random_prompts(3, 8, 1, (100, 200))
    r = asyncio.run(run_benchmark(fake_server, "m", prompts, N, max_concurrency=1))
    one = FIRST + (N - 1) * GAP
    assert r["duration_s"] >= 3 * one * 0.95  # one at a time


def test_multi_turn_workload(fake_server):
    """Users' prompts grow by U user tokens + the N reply ids per turn on a shared system prompt;
    TTFT and hit rate per turn."""
    from linrnn_bench.serve import format_turns, run_multi_turn

    PROMPTS.clear()
    r = asyncio.run(run_multi_turn(fake_server, "m", num_users=2, num_turns=3, system_len=10, user_len=4,
                                   output_len=N, seed=1))
    assert r["completed"] == 6 and r["replies_as_ids"] and len(r["turns"]) == 3
    convs = PROMPTS[1:]  # after the warm-up
    assert sorted(len(p) for p in convs) == sorted([14, 24, 34] * 2)
    assert all(p[:10] == convs[0][:10] for p in convs)  # the shared system prompt
    for p in convs:
        if len(p) > 14:
            assert p[14:14 + N] == [7000 + i for i in range(N)]  # the reply, as ids
    assert all(FIRST * 1000 - EARLY_MS <= t["ttft_ms"]["median"] for t in r["turns"])
    assert r["turns"][1]["hit_rate"] == pytest.approx(0.5) and r["turns"][1]["prompt_tokens_mean"] == 24
    assert "| 3 | 34 |" in format_turns(r)
    # every request's record (turn, user, id, send time, TTFT, E2EL, prompt, cached), lined up with a server
    # trace by tools/prefix_timeline.py: here a synthetic one with known gaps
    recs = r["requests"]
    assert sorted((x[0], x[1]) for x in recs) == [(t, u) for t in (1, 2, 3) for u in (0, 1)]
    assert len({x[2] for x in recs}) == 6 and all(x[2].startswith("cmpl-") for x in recs)
    assert all(x[4] >= FIRST - EARLY_MS / 1000 and x[5] >= x[4] and x[7] == x[6] // 2 for x in recs)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:  # tools/ is a folder of the checkout, not an installed package
        sys.path.insert(0, repo)
    from tools import prefix_timeline

    core, server = [], {"events": []}
    for x in recs:  # hand-over 4 ms after the send, the core's add 6 ms later, its first token 5 ms before the client's
        server["events"].append(["add_sent", x[3] + 0.004, x[2]])
        core.append(["add", x[3] + 0.010, x[2]])
        core.append(["step", x[3] + 0.011, x[3] + 0.012, 1, [3, 1, 9, 0, 1, 0]])
        core.append(["core", x[3] + x[4] - 0.005, [[x[2], 1]]])
    t0 = min(x[3] for x in recs)  # garbage collections: start-up ones (before the first send) are left out
    server["events"] += [["gc", t0 - 5.0, 2, 0.300], ["gc", t0 + 0.001, 2, 0.0125], ["gc", t0 + 0.002, 0, 0.003]]
    core.append(["gc", t0 + 0.003, 1, 0.004])
    out = prefix_timeline.analyse({"runs": [r]}, core, server, steps_turn=2)
    assert "API server: 2 traced garbage collections during the run, 15.5 ms in all, longest 12.5 ms" in out
    assert "engine core: 1 traced garbage collections during the run, 4.0 ms in all, longest 4.0 ms" in out
    row = next(line for line in out.splitlines() if line.startswith("| 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:4] == ["4.0", "6.0"] and cells[5] == "5.0" and cells[9] == "9"
    assert float(cells[4]) == pytest.approx(float(cells[1]) - 15.0, abs=0.11)  # add -> first token = TTFT - 15 ms
    assert "| 3 | 1 | 9 | 0 | 1 | 0 |" in out  # turn 2's steps, listed


def test_unreachable_server_reports_failures():
    r = asyncio.run(run_benchmark("http://127.0.0.1:9", "m", random_prompts(2, 4, 0, (1, 5)), 4, 2, timeout=2))
    assert r["completed"] == 0 and r["failed"] == 2 and r["errors"]


def test_wave_analysis_of_a_core_trace():
    """benchmarks/wave.py on a synthetic core trace: two waves of 4 requests (out 3); the second wave's successors
    come back 5 ms after the first wave's last tokens, one 4 ms before the rest, and are prefilled in two
    steps (the second beside one decode row)."""
    from linrnn_bench.wave import summary, waves

    ev = [["add", 0.000 + 0.001 * i, f"a{i}"] for i in range(4)]
    ev += [["step", 0.004, 0.005, 0, [0, 4, 32, 0, 0, 0]], ["core", 0.010, [(f"a{i}", 1) for i in range(4)]],
           ["core", 0.020, [(f"a{i}", 2) for i in range(4)]], ["core", 0.030, [(f"a{i}", 3) for i in range(4)]]]
    ev += [["add", 0.035, "b0"], ["step", 0.036, 0.037, 0, [0, 1, 8, 0, 0, 0]]]
    ev += [["add", 0.039 + 0.0001 * i, f"b{i}"] for i in range(1, 4)]
    ev += [["step", 0.040, 0.041, 1, [1, 3, 24, 0, 0, 0]], ["core", 0.045, [("b0", 1)]],
           ["core", 0.050, [(f"b{i}", 1) for i in range(1, 4)]]]
    ws = waves(ev, 4, 3, gap_s=0.0045)
    assert [w["requests"] for w in ws] == [4, 4]
    w = ws[1]
    assert w["hand_back_ms"] == pytest.approx(5.0) and w["spread_ms"] == pytest.approx(4.3)
    assert w["wait_ms"] == pytest.approx(1.0) and w["prefill_steps"] == 2
    assert w["prefill_tokens"] == [8, 24] and w["decode_rows_beside"] == [0, 1]
    assert w["first_token_ms"] == pytest.approx(15.0) and ws[0]["wave_ms"] == pytest.approx(35.0)
    assert w["to_launch_ms"] == pytest.approx(6.0)  # the last tokens at 30 ms -> b0's prefill launched at 36 ms
    assert summary(ws, 4)["prefill_steps"] == 2  # wave 0 (the start) is left out
    # the API server's side: the finished streams' last frames written by 31.6 ms (their tokens before: not
    # final), the first request of the wave at its ASGI entry at 33 ms, the last handed to the core at 38.9 ms
    server = [["sse", 0.0305, [(f"a{i}", 3)], 0.0002 + 0.0003 * i] for i in range(4)]
    server += [["sse", 0.021, [("a0", 2)], 0.0], ["sse", 0.050, [("b1", 1)], 0.0]]
    server += [["http_in_rid", 0.033, "b0"], ["add_sent", 0.0349, "b0"]]
    server += [["http_in_rid", 0.038 + 0.0001 * i, f"b{i}"] for i in range(1, 4)]
    server += [["add_sent", 0.0386 + 0.0001 * i, f"b{i}"] for i in range(1, 4)]
    ws = waves(ev, 4, 3, gap_s=0.0045, server=server)
    assert ws[1]["server_finish_ms"] == pytest.approx(1.6) and ws[1]["turnaround_ms"] == pytest.approx(1.4)
    assert ws[1]["server_intake_ms"] == pytest.approx(5.9) and "server_finish_ms" not in ws[0]
    assert summary(ws, 4)["turnaround_ms"] == pytest.approx(1.4)
