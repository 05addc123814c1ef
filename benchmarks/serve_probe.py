"""Where a streamed token's time goes between the engine core and the HTTP client (issue #14 probe).

    python -m linrnn_bench.serve_probe server --trace-dir DIR [--loop auto|asyncio|uvloop] -- [linrnn-serve args]
    python -m linrnn_bench.serve_probe client --base-url URL --trace-dir DIR [--requests 4] [--input-len 128]
        [--output-len 128] [--out FILE.json]

`server` runs `linrnn-serve` with timestamps patched in at every hop (nothing in the serving code
changes: the probe wraps objects at start-up; the engine core runs as `serve_probe core`, which wraps
the core's objects, then calls the core's main):

    core     the engine core encodes a step's StepOutputs (right before its ZeroMQ send)
    gc       a garbage collection that stopped the core or the server for more than GC_MIN_S (not a hop)
    recv     the API server's receiver thread has the message (decoded)
    applied  ... has appended it to the request's state and detokenized it (then wakes the event loop)
    wake     the event loop runs the wake-up callback
    yield    the request's generator yields the cumulative output to the route
    sse      the route hands the SSE frame to the HTTP server (ASGI send)
    client   the client has the frame: a raw socket reader (`raw`) or httpx's aiter_lines (`httpx`,
             as `bench serve` reads)

All clocks are CLOCK_MONOTONIC (one host). For each token j of each request, a hop's time is that of
its first event carrying token j. The client prints, per hop, the distribution of the added latency
(hop minus previous hop) and of the gap between consecutive tokens at that hop ("ITL at the hop"):
the hop where the ITL jumps from the engine's step time to a burst interval is where tokens pile up.
`client` runs its requests one at a time (concurrency 1), alternating raw and httpx readers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import sys
import time
from urllib.parse import urlparse

TRACE_ENV = "LINRNN_PROBE_DIR"
LOOP_ENV = "LINRNN_PROBE_LOOP"
now = time.monotonic

GC_MIN_S = 0.002  # collections shorter than this are not recorded


def watch_gc(record) -> None:
    """Call record(start, generation, seconds) after every garbage collection of this process that took more
    than GC_MIN_S: a full collection over a large heap stops every thread of the process (the event loop's
    streams, the core's steps) for as long as it runs."""
    import gc

    started = [0.0]

    def cb(phase, info):
        if phase == "start":
            started[0] = now()
        elif now() - started[0] > GC_MIN_S:
            record(started[0], info["generation"], now() - started[0])

    gc.callbacks.append(cb)


# ---------------------------------------------------------------------------------------------------
# engine-core process


def core_main(argv: list[str]) -> None:
    import linrnn_serve.engine.core as core
    from linrnn_serve.engine.protocol import StepOutputs

    path = os.path.join(os.environ[TRACE_ENV], f"core-{os.getpid()}.jsonl")
    buf: list[str] = []
    cum: dict[str, int] = {}

    def flush():
        with open(path, "a") as f:
            f.write("".join(buf))
        buf.clear()

    real_encoder = core.encoder

    class Encoder:  # the core's encoder, timestamping each step's outputs right before the send
        def encode(self, msg):
            if isinstance(msg, StepOutputs) and (msg.deltas or msg.token_ids):
                t = now()
                toks = []
                done = any(d.finished for d in msg.deltas)
                for rid, k in msg.new_tokens():
                    n = cum.get(rid, 0) + k
                    cum[rid] = n
                    toks.append((rid, n))
                buf.append(json.dumps(["core", t, toks]) + "\n")
                if done:  # flush while the engine is between requests
                    flush()
            return real_encoder.encode(msg)

    core.encoder = Encoder()
    add, step = core.EngineCore.add, core.EngineCore.step

    def traced_add(self, msg):
        buf.append(json.dumps(["add", now(), msg.request_id]) + "\n")
        return add(self, msg)

    def traced_step(self, out=None):
        t0 = now()
        out = step(self, out)
        p, sch = self.engine.last_plan, self.engine.scheduler
        # the plan this call launched: decode rows, prefill rows / tokens, cached first tokens, restores, waiting
        comp = [len(p.decode), len(p.prefill), sum(len(r.token_ids) for r in p.prefill), len(p.cached),
                len(p.snapshot_restores), len(sch.waiting)] if p is not None else []
        buf.append(json.dumps(["step", t0, now(), len(out.deltas) + len(out.token_ids), comp]) + "\n")
        return out

    core.EngineCore.add, core.EngineCore.step = traced_add, traced_step
    watch_gc(lambda t, gen, d: buf.append(json.dumps(["gc", t, gen, d]) + "\n"))
    try:
        core.main(argv)
    finally:
        flush()


# ---------------------------------------------------------------------------------------------------
# API-server process


class ServerTrace:
    def __init__(self):
        self.events: list[list] = []
        self.cum_recv: dict[str, int] = {}
        self.last_yield: dict[str, int] = {}

        self.loop_lag: list[float] = []  # seconds a 1 ms sleep overshot, the event loop's busy stretches
        self.lag_task = None

    def add(self, *ev) -> None:
        # tuples of numbers and strings (the token lists too): the collector stops tracking them, so the
        # growing trace does not lengthen the server's garbage collections (what `gc` events measure)
        self.events.append(tuple(tuple(x) if isinstance(x, list) else x for x in ev))


LAG_TICK_S = 0.001


async def watch_loop_lag(into: list[float]) -> None:
    """How late the event loop runs a callback: sleep LAG_TICK_S, record the overshoot, repeat."""
    while True:
        t = now()
        await asyncio.sleep(LAG_TICK_S)
        into.append(now() - t - LAG_TICK_S)


def install_server_probe(trace: ServerTrace) -> None:
    import subprocess

    import linrnn_serve.engine.core_client as cc
    import linrnn_serve.engine.request_state as rs
    import linrnn_server.app as app_mod
    from linrnn_server.engine_client import EngineClient

    class _Subprocess:  # starts the core as `serve_probe core` (same arguments)
        def __getattr__(self, name):
            return getattr(subprocess, name)

        @staticmethod
        def Popen(args, **kw):
            args = list(args)
            i = args.index("linrnn_serve.engine.core")
            args[i:i + 1] = ["linrnn_bench.serve_probe", "core"]
            return subprocess.Popen(args, **kw)

    cc.subprocess = _Subprocess()
    watch_gc(lambda t, gen, d: trace.add("gc", t, gen, d))
    real_decoder = cc.outputs_decoder

    class Decoder:
        def decode(self, data):
            t = now()
            msg = real_decoder.decode(data)
            toks = []
            for rid, k in msg.new_tokens():
                n = trace.cum_recv.get(rid, 0) + k
                trace.cum_recv[rid] = n
                toks.append((rid, n))
            if toks:
                trace.add("recv", t, toks)
            return msg

    cc.outputs_decoder = Decoder()

    def ntoks(st) -> int:
        return sum(len(s.token_ids) for s in st.seqs or ())

    real_apply = rs.RequestState.apply

    def apply(self, d):
        real_apply(self, d)
        trace.add("applied", now(), [(self.request_id, ntoks(self))])

    rs.RequestState.apply = apply
    real_wake = rs.wake

    def wake(states):
        trace.add("wake", now(), [(st.request_id, ntoks(st)) for st in states])
        real_wake(states)

    rs.wake = wake
    real_send = cc.AsyncMPClient._send

    def send(self, msg):
        if isinstance(msg, cc.AddRequest):
            trace.add("add_sent", now(), msg.request_id)
        return real_send(self, msg)

    cc.AsyncMPClient._send = send
    real_generate = EngineClient.generate

    async def generate(self, prompt_ids, params, request_id):
        async for out in real_generate(self, prompt_ids, params, request_id):
            n = sum(len(c.token_ids) for c in out.outputs)
            trace.last_yield[request_id] = n
            trace.add("yield", now(), [(request_id, n)])
            yield out

    EngineClient.generate = generate
    real_build = app_mod.build_app
    id_re = re.compile(rb'^data: \{"id":"([^"]+)"')

    class TraceASGI:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            if scope["path"] == "/probe/trace":
                body = json.dumps({"loop": type(asyncio.get_running_loop()).__module__ + "." +
                                   type(asyncio.get_running_loop()).__name__, "events": trace.events, "loop_lag": trace.loop_lag}).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
            t_in = now()
            trace.add("http_in", t_in, scope["path"])
            if trace.lag_task is None:
                trace.lag_task = asyncio.ensure_future(watch_loop_lag(trace.loop_lag))
            t_body = [None]
            named = [False]

            async def traced_receive():
                msg = await receive()
                if msg["type"] == "http.request" and not msg.get("more_body") and t_body[0] is None:
                    t_body[0] = now()
                return msg

            async def traced_send(msg):
                if msg["type"] == "http.response.body":
                    body = msg.get("body", b"")
                    m = id_re.match(body)
                    if m:
                        rid = m.group(1).decode()
                        t = now()
                        if not named[0]:  # this request's ASGI call and body read, by the response's id
                            named[0] = True
                            trace.add("http_in_rid", t_in, rid)
                            if t_body[0] is not None:
                                trace.add("body_in_rid", t_body[0], rid)
                        await send(msg)
                        trace.add("sse", t, [(rid, trace.last_yield.get(rid, 0))], now() - t)
                        return
                await send(msg)

            return await self.app(scope, traced_receive, traced_send)

    def build_app(*a, **kw):
        app = real_build(*a, **kw)
        app.add_middleware(TraceASGI)
        return app

    app_mod.build_app = build_app
    loop = os.environ.get(LOOP_ENV)
    if loop:
        import uvicorn

        real_init = uvicorn.Config.__init__

        def init(self, *a, **kw):
            kw["loop"] = loop
            real_init(self, *a, **kw)

        uvicorn.Config.__init__ = init


def server_main(trace_dir: str, loop: str | None, serve_args: list[str]) -> int:
    os.makedirs(trace_dir, exist_ok=True)
    os.environ[TRACE_ENV] = os.path.abspath(trace_dir)
    if loop and loop != "auto":
        os.environ[LOOP_ENV] = loop
    install_server_probe(ServerTrace())
    from linrnn_server.cli import main

    return main(serve_args)


# ---------------------------------------------------------------------------------------------------
# client

FRAME_RE = re.compile(rb"data: ([^\n]*)\n\n")


def request_body(prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()


def raw_request(base_url: str, body: bytes) -> tuple[float, list[tuple[float, str]], list[int]]:
    """POST over a plain socket; (send time, [(receive time, frame id) per data frame], frames per recv)."""
    u = urlparse(base_url)
    s = socket.create_connection((u.hostname, u.port or 80))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    frames: list[tuple[float, str]] = []
    per_recv: list[int] = []
    buf = b""
    t0 = now()
    s.sendall(head + body)
    try:
        while True:
            data = s.recv(1 << 16)
            t = now()
            if not data:
                break
            buf += data
            k = 0
            pos = 0
            for m in FRAME_RE.finditer(buf):
                frames.append((t, _frame_id(m.group(1))))
                k += 1
                pos = m.end()
            buf = buf[pos:]
            per_recv.append(k)
            if frames and frames[-1][1] == "[DONE]":
                break
    finally:
        s.close()
    return t0, frames, per_recv


def _frame_id(data: bytes) -> str:
    if data.strip() == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)["id"]
    except (ValueError, KeyError):
        return "?"


async def httpx_request(client, base_url: str, body: bytes) -> tuple[float, list[tuple[float, str]]]:
    frames = []
    t0 = now()
    async with client.stream("POST", base_url + "/v1/completions", content=body,
                             headers={"Content-Type": "application/json"}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                frames.append((now(), _frame_id(line[5:].strip().encode())))
    return t0, frames


def first_at(events: list[tuple[float, int]], n_tokens: int) -> list[float | None]:
    """For tokens 1..n, the time of the first event whose cumulative count covers it."""
    out: list[float | None] = [None] * (n_tokens + 1)
    j = 1
    for t, cum in sorted(events):
        while j <= min(cum, n_tokens):
            out[j] = t
            j += 1
    return out


HOPS = ("core", "recv", "applied", "wake", "yield", "sse", "client")


def analyse(reqs: list[dict], server: dict, core: list[list], n_tokens: int) -> dict:
    """Per-hop added latency and ITL distributions over every token of every request."""
    per_rid: dict[str, dict[str, list[tuple[float, int]]]] = {}

    def put(hop, t, rid, cum):
        per_rid.setdefault(rid, {}).setdefault(hop, []).append((t, cum))

    for ev in core:
        if ev[0] == "core":
            for rid, cum in ev[2]:
                put("core", ev[1], rid, cum)
    adds = {ev[2]: ev[1] for ev in core if ev[0] == "add"}
    steps = [ev for ev in core if ev[0] == "step"]
    sse_by_rid: dict[str, list[tuple[float, int]]] = {}
    add_sent = {}
    for ev in server["events"]:
        if ev[0] in ("recv", "applied", "wake", "yield", "sse"):
            for rid, cum in ev[2]:
                put(ev[0], ev[1], rid, cum)
                if ev[0] == "sse":
                    sse_by_rid.setdefault(rid, []).append((ev[1], cum))
        elif ev[0] == "add_sent":
            add_sent[ev[2]] = ev[1]
    lat: dict[str, list[float]] = {h: [] for h in HOPS}
    itl: dict[str, list[float]] = {h: [] for h in HOPS}
    events_per_req: dict[str, list[int]] = {h: [] for h in HOPS}
    ttft_parts: dict[str, list[float]] = {}
    for r in reqs:
        rid = r["rid"]
        hops = per_rid.get(rid, {})
        # the client's k-th frame carries what the server's k-th SSE frame carried
        sse = sorted(sse_by_rid.get(rid, []))
        cl = [(t, sse[k][1]) for k, t in enumerate(r["frame_times"]) if k < len(sse)]
        hops["client"] = cl
        times = {h: first_at(hops.get(h, []), n_tokens) for h in HOPS}
        for h in HOPS:
            events_per_req[h].append(len({t for t, _ in hops.get(h, [])}))
        for j in range(1, n_tokens + 1):
            prev = None
            for h in HOPS:
                t = times[h][j]
                if t is None:
                    prev = None
                    continue
                if prev is not None:
                    lat[h].append(t - prev)
                if j > 1 and times[h][j - 1] is not None:
                    itl[h].append(t - times[h][j - 1])
                prev = t
        first_core = times["core"][1]
        parts = {"client send -> server add_sent": (r["t0"], add_sent.get(rid)),
                 "add_sent -> core add": (add_sent.get(rid), adds.get(rid)),
                 "core add -> first token sent": (adds.get(rid), first_core),
                 "first token sent -> client": (first_core, times["client"][1]),
                 "TTFT (client)": (r["t0"], times["client"][1])}
        for k, (a, b) in parts.items():
            if a is not None and b is not None:
                ttft_parts.setdefault(k, []).append(b - a)
    step_ms = [1e3 * (e[2] - e[1]) for e in steps if e[3] > 0]
    return {"latency_ms": {h: dist(v) for h, v in lat.items() if v},
            "itl_ms": {h: dist(v) for h, v in itl.items() if v},
            "events_per_request": {h: statistics.mean(v) if v else 0 for h, v in events_per_req.items()},
            "ttft_ms": {k: dist(v) for k, v in ttft_parts.items()},
            "core_step_ms": dist([s / 1e3 for s in step_ms]) if step_ms else None}


def dist(v: list[float]) -> dict:
    s = sorted(v)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"n": len(s), "median": 1e3 * statistics.median(s), "p10": 1e3 * q(0.1), "p90": 1e3 * q(0.9),
            "max": 1e3 * s[-1], "share_under_0.3ms": sum(x < 3e-4 for x in s) / len(s)}


def format_report(name: str, a: dict, loop: str) -> str:
    lines = [f"### {name} (server event loop: {loop})", "",
             "| hop | events / request | added latency median / p90 / max ms | ITL at hop median / p90 ms | "
             "ITL < 0.3 ms |", "|---|---:|---:|---:|---:|"]
    for h in HOPS:
        la, it = a["latency_ms"].get(h), a["itl_ms"].get(h)
        las = f"{la['median']:.3f} / {la['p90']:.3f} / {la['max']:.2f}" if la else "-"
        its = f"{it['median']:.3f} / {it['p90']:.3f}" if it else "-"
        under = f"{100 * it['share_under_0.3ms']:.0f} %" if it else "-"
        lines.append(f"| {h} | {a['events_per_request'][h]:.1f} | {las} | {its} | {under} |")
    lines += ["", "| TTFT part | median ms | max ms |", "|---|---:|---:|"]
    for k, d in a["ttft_ms"].items():
        lines.append(f"| {k} | {d['median']:.2f} | {d['max']:.2f} |")
    if a["core_step_ms"]:
        lines.append(f"\ncore step() wall time: median {a['core_step_ms']['median']:.3f} ms, "
                     f"p90 {a['core_step_ms']['p90']:.3f} ms")
    return "\n".join(lines)


def client_main(args) -> int:
    import random

    import httpx

    base = args.base_url.rstrip("/")
    rng = random.Random(args.seed)
    # warm-up (not measured)
    raw_request(base, request_body([rng.randrange(100, 1000) for _ in range(args.input_len)], 8))
    runs: dict[str, list[dict]] = {"raw": [], "httpx": []}
    pids = [int(p) for p in args.pids.split(",") if p]
    before = thread_stats(pids)

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(args.requests):
                body = request_body([rng.randrange(100, 1000) for _ in range(args.input_len)], args.output_len)
                kind = "raw" if i % 2 == 0 else "httpx"
                if kind == "raw":
                    t0, frames, per_recv = await asyncio.to_thread(raw_request, base, body)
                else:
                    t0, frames = await httpx_request(client, base, body)
                    per_recv = []
                rid = next(f for _, f in frames if f not in ("[DONE]", "?"))
                runs[kind].append({"rid": rid, "t0": t0, "per_recv": per_recv,
                                   "frame_times": [t for t, f in frames if f == rid]})

    asyncio.run(go())
    threads = thread_diff(before, thread_stats(pids)) if pids else ""
    server = httpx.get(base + "/probe/trace", timeout=30).json()
    core: list[list] = []
    for name in os.listdir(args.trace_dir):
        if name.startswith("core-") and name.endswith(".jsonl"):
            with open(os.path.join(args.trace_dir, name)) as f:
                core += [json.loads(line) for line in f if line.strip()]
    result = {"loop": server["loop"], "args": vars(args)}
    out = [f"serve_probe: {args.requests} requests at concurrency 1, in {args.input_len} / out {args.output_len}"]
    for kind, reqs in runs.items():
        if not reqs:
            continue
        a = analyse(reqs, server, core, args.output_len)
        a["frames_per_recv"] = [k for r in reqs for k in r["per_recv"] if k]
        result[kind] = a
        out.append(format_report(f"client reader: {kind}", a, server["loop"]))
        if a["frames_per_recv"]:
            f = a["frames_per_recv"]
            out.append(f"raw socket: {len(f)} recv() calls with frames, {statistics.mean(f):.2f} frames per recv "
                       f"(max {max(f)})")
    if threads:
        out.append("threads over the run (server, core):\n\n" + threads)
        result["threads"] = threads
    print("\n\n".join(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def thread_stats(pids: list[int]) -> dict:
    """Per thread of each process: name, CPU seconds, voluntary / involuntary context switches, allowed CPUs
    (involuntary switches of a mostly sleeping thread mean it waited for a CPU)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            base = f"/proc/{pid}/task/{tid}"
            try:
                stat = open(f"{base}/stat").read()
                status = dict(line.split(":\t", 1) for line in open(f"{base}/status").read().splitlines()
                              if ":\t" in line)
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out[f"{pid}/{tid}"] = {"name": status.get("Name", "?").strip(),
                                   "cpu_s": (int(fields[11]) + int(fields[12])) / tick,
                                   "vol": int(status.get("voluntary_ctxt_switches", 0)),
                                   "invol": int(status.get("nonvoluntary_ctxt_switches", 0)),
                                   "cpus": status.get("Cpus_allowed_list", "?").strip()}
    return out


def thread_diff(before: dict, after: dict) -> str:
    lines = ["| pid/tid | thread | CPU s | voluntary switches | involuntary switches | allowed CPUs |",
             "|---|---|---:|---:|---:|---|"]
    for k, a in after.items():
        b = before.get(k, {"cpu_s": 0.0, "vol": 0, "invol": 0})
        d = a["cpu_s"] - b["cpu_s"], a["vol"] - b["vol"], a["invol"] - b["invol"]
        if d[0] > 0.005 or d[1] or d[2]:
            lines.append(f"| {k} | {a['name']} | {d[0]:.2f} | {d[1]} | {d[2]} | {a['cpus']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "core":
        core_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m linrnn_bench.serve_probe")
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--trace-dir", required=True)
    s.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="uvicorn's event loop (auto: uvloop when installed)")
    s.add_argument("serve_args", nargs=argparse.REMAINDER)
    c = sub.add_parser("client")
    c.add_argument("--base-url", required=True)
    c.add_argument("--trace-dir", required=True)
    c.add_argument("--requests", type=int, default=4)
    c.add_argument("--input-len", type=int, default=128)
    c.add_argument("--output-len", type=int, default=128)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default=None)
    c.add_argument("--pids", default="", help="comma list: the server's and core's pids (per-thread CPU and "
                   "context switches over the run)")
    args = p.parse_args(argv)
    if args.mode == "server":
        rest = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        return server_main(args.trace_dir, args.loop, rest)
    return client_main(args)


if __name__ == "__main__":
    sys.exit(main())
