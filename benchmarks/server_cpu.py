"""The API server's CPU time per phase of a c = 64 wave, in process (issue #14, the c = 64 line's hand-back).

    python -m linrnn_bench.server_cpu [--requests 64] [--rounds 30] [--out FILE.json]

The app (`build_app`) on uvloop, driven directly through ASGI (no sockets, no HTTP parsing: what uvicorn adds is
left out) over a fake engine whose streams advance only when told, 64 streamed /v1/completions requests (prompt
128 token ids, as `bench serve` sends them) at a time. CPU time of this process (time.process_time, so other
processes' load on the machine barely moves it), per phase and all 64 requests:

    intake   the 64 requests parsed and handed to the engine (each then waits for its first output)
    first    every stream's first output: 200 header and first SSE frame
    token    one more output per stream (a decode step's share)
    finish   every stream's last output: final frame, usage, [DONE], the response's end and the request's teardown

intake and finish are the server's own share of a wave's hand-back (benchmarks/results/serving/handback_cpu/);
min and median over the rounds. Also the ASGI body messages per finished stream (each is one write).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput

PHASES = ("intake", "first", "token", "finish")


class SteppedEngine:
    """An engine whose requests get their outputs when `step(k)` releases the k-th (0: first token, 1: one
    more, 2: the last, finished)."""

    tokenizer = None
    max_model_len = 4096
    model_name = "m"
    default_sampling_params: dict = {}
    is_running = True

    def __init__(self):
        self.events: list[asyncio.Event] = []

    def reset(self) -> None:
        self.events = [asyncio.Event() for _ in range(3)]

    def step(self, k: int) -> None:
        self.events[k].set()

    async def generate(self, ids, params, request_id):
        n = params.max_tokens
        for k, cum in enumerate((1, 2, n)):
            await self.events[k].wait()
            done = cum == n
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "ab" * cum, [7] * cum, None,
                                                                         "length" if done else None)], done)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {}


def request(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5555),
            "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


async def measure(requests: int, rounds: int, settle_s: float = 0.02) -> dict:
    from linrnn_server.app import build_app

    engine = SteppedEngine()
    app = build_app(engine, ["m"], owns_engine=False)
    body = json.dumps({"model": "m", "prompt": list(range(100, 228)), "max_tokens": 128, "stream": True,
                       "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    bodies: list[dict] = []

    async def one() -> None:
        read = [False]
        done = asyncio.Event()

        async def receive():
            if not read[0]:
                read[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body":
                bodies.append(msg)
                if not msg.get("more_body", False):
                    done.set()

        await app(request(body), receive, send)

    cpu: dict[str, list[float]] = {p: [] for p in PHASES}
    per_finish = 0.0
    for _ in range(rounds + 1):  # the first round warms up (lazy imports, the middleware stack)
        engine.reset()
        marks = [time.process_time()]
        tasks = [asyncio.ensure_future(one()) for _ in range(requests)]
        for k in range(3):
            await asyncio.sleep(settle_s)  # every stream has run up to its next wait
            marks.append(time.process_time())
            bodies.clear()
            engine.step(k)
        await asyncio.gather(*tasks)
        marks.append(time.process_time())
        per_finish = len(bodies) / requests
        for p, a, b in zip(PHASES, marks, marks[1:]):
            cpu[p].append(1e3 * (b - a))
    out = {p: {"min_ms": min(v[1:]), "median_ms": statistics.median(v[1:])} for p, v in cpu.items()}
    return {"requests": requests, "rounds": rounds, "cpu": out, "body_messages_per_finished_stream": per_finish}


def format_result(r: dict, label: str = "") -> str:
    lines = [f"| phase ({r['requests']} requests, CPU ms: min / median of {r['rounds']}) | {label} |", "|---|---:|"]
    lines += [f"| {p} | {r['cpu'][p]['min_ms']:.2f} / {r['cpu'][p]['median_ms']:.2f} |" for p in PHASES]
    lines.append(f"| ASGI body messages per finished stream | {r['body_messages_per_finished_stream']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linrnn_bench.server_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvicorn's loop when installed, as the server runs
        runner = asyncio.Runner()
    with runner:
        r = runner.run(measure(a.requests, a.rounds))
    print(format_result(r, a.label))
    if a.out:
        from linrnn_bench.handover import run_stamp

        with open(a.out, "w") as f:
            json.dump({**r, "label": a.label, **run_stamp()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
